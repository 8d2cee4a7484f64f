"""inspect's report: a file's (`file`) and a folder's (`folder`), text and --json; its first lines and units are
runtime.inspect.answer's."""
from runtime.inspect.report.file import as_json, report
from runtime.inspect.report.folder import folder_json, folder_report

__all__ = ["as_json", "folder_json", "folder_report", "report"]
