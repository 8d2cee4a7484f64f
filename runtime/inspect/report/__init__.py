"""inspect's report: a file's (`file`), a folder's (`folder`) and a transformers.js folder's variants'
(`variants`), text and --json; its first lines and units are runtime.inspect.answer's."""
from runtime.inspect.report.file import as_json, report
from runtime.inspect.report.folder import folder_json, folder_report
from runtime.inspect.report.variants import variants_json, variants_report

__all__ = ["as_json", "folder_json", "folder_report", "report", "variants_json", "variants_report"]
