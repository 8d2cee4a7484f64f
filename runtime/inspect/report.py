"""The text report and the --json document of runtime.inspect, from inspect_model's findings."""

from runtime.inspect import memory
from runtime.inspect.relations import SMALL_COPY

_DISTINCT_LISTED = 16  # more distinct pairs than this are counted in the text report, not listed


def report(info, path, out):
    """The text report of `info` (cli.inspect_model) for the model at `path`, written to `out`."""
    w = out.write
    w(f"{path}: {len(info['initializers'])} initializers, {info['file_bytes']} bytes on disk; as onnxruntime "
      f"{info['onnxruntime']} loads and runs it\n")
    if info["vocabulary"]:
        v = info["vocabulary"][0]
        w(f"parameters: {v['parameters_counted']}, as Hugging Face counts them: {v['parameters_what']}\n")
    for v in info["vocabulary"]:
        tie = f"tied to head {v['head']}" if v["tied"] else "not tied"
        w(f"vocabulary: {'position table' if v['kind'] == 'position' else 'table'} {v['table']} {v['vocab_size']} x "
          f"{v['width']} {v['format']}, {v['bytes']} bytes, {tie}; {v['parameter_share']:.1%} of the parameters, "
          f"{v['byte_share']:.1%} of the bytes\n")
        for line in _details(v):
            w(f"  {line}\n")
        w(f"  in memory: {_held(v['in_memory'], info.get('measure_error'))}\n")
    if not info["vocabulary"]:
        w("vocabulary: no table (no Gather, GatherBlockQuantized or OneHot + MatMul reads rows from an initializer)\n")
    w(f"  {'name':<32} {'dtype':<8} {'shape':<16} {'elements':>12} {'bytes':>12}\n")
    for i in info["initializers"]:
        w(f"  {i['name']:<32} {i['dtype']:<8} {str(i['shape']):<16} {i['elements']:>12} {i['bytes']:>12}\n")
    tables = [f"{t['initializer']} ({t['node'].op_type}{_views(t)})" for t in info["tables"]]
    w("tables (read by Gather/GatherBlockQuantized/OneHot+MatMul): " + (", ".join(tables) or "none") + "\n")
    heads = [f"{h['initializer']} ({h['node'].op_type}{_views(h)})" for h in info["heads"]]
    w("heads (MatMul/Gemm/FusedMatMul/MatMulNBits/integer matmul weights): " + (", ".join(heads) or "none") + "\n")
    distinct = [p for p in info["pairs"] if p["relation"] == "distinct"]
    listed = [p for p in info["pairs"] if p["relation"] != "distinct" or len(distinct) <= _DISTINCT_LISTED]
    for p in listed:
        unit = "their mean scale" if p["both_quantized"] else "the quantized one's scale"
        gap = (f" (largest difference {p['max_error_in_scales']:.3g} of {unit})"
               if p["relation"] == "quantized_copy" else "")
        w(f"pair {p['table']} / {p['head']}: {p['relation']}{gap}, {p['wasted_bytes']} bytes wasted in the file\n")
    if len(distinct) > _DISTINCT_LISTED:
        w(f"{len(distinct)} table/head pairs of matching shape are distinct (each listed under --json)\n")
    if not info["pairs"]:
        w("no table/head pair of matching shape\n")
    small = [c for c in info["runtime_copies"] if c["bytes"] < SMALL_COPY and "copy_of" not in c]
    for c in info["runtime_copies"]:
        if c in small:
            continue
        if c.get("view") == "prepacked":
            w(f"prepacked copy of {c['copy_of']}: {c['bytes']} bytes made at load by {c['kernel']} node "
              f"{c['node']!r} under onnxruntime's defaults (no initializer of the optimized model shows it)\n")
            continue
        what = f" = {c['copy_of']}{'' if c['view'] == 'same' else ' ' + c['view']}" if "copy_of" in c else ""
        w(f"runtime copy {c['name']} {c['shape']}: {c['bytes']} bytes added by onnxruntime's optimizations{what}\n")
    if small:
        w(f"runtime copies under {SMALL_COPY} bytes: {len(small)} (folded constants), "
          f"{sum(c['bytes'] for c in small)} bytes in all\n")
    if not info["runtime_copies"]:
        w("runtime copies: none (onnxruntime's optimized model adds no initializer)\n")


def _details(v):
    """The vocabulary entry's other facts, one line each: padding, the rows' scale, a quantized copy as head."""
    if v["padded_width"]:
        yield f"codes padded to {v['padded_width']} columns (whole blocks); a Slice cuts the rows back to {v['width']}"
    if v["row_scale"] is not None:
        what = (f"sqrt({v['width']}): the sqrt(width) scaling" if v["row_scale_is_sqrt_width"] else
                f"not sqrt({v['width']}) = {v['width'] ** 0.5:.6g}")
        yield f"looked-up rows multiplied by {v['row_scale']:.6g}, {what}"
    if v["quantized_head"]:
        q = v["quantized_head"]
        if q["wasted_bytes"]:  # both quantized, each from the same floats
            yield (f"head {q['head']} holds these values quantized a second way (largest difference "
                   f"{q['max_error_in_scales']:.3g} of their mean scale): a copy up to rounding, not a tie; "
                   f"{q['wasted_bytes']} bytes")
        else:
            yield (f"head {q['head']} holds these values quantized (largest difference {q['max_error_in_scales']:.3g} "
                   "of its scale): a copy up to rounding, not a tie")


def _copies(n):
    return f"{n} cop{'y' if n == 1 else 'ies'}"


def _held(entry, error):
    """One line: what a session holds under the defaults, and what turning prepacking off changes."""
    def figures(held):
        if held["resident_bytes"] is None:
            return "not measured"
        ratio = ("the table too small for a ratio" if held["times_table"] is None else
                 f"{held['times_table']:.2f}x the table beyond the other weights")
        return (f"+{held['resident_bytes'] / 2**20:.1f} MiB resident after a run, {held['anonymous_bytes'] / 2**20:.1f} "
                f"anonymous and {held['file_bytes'] / 2**20:.1f} file-backed: {ratio}")
    defaults, off = entry["defaults"], entry["no_prepacking"]
    line = (f"{_copies(defaults['copies'])} under onnxruntime's default SessionOptions ({figures(defaults)}); "
            f"{_copies(off['copies'])} with {memory.NO_PREPACKING} ({figures(off)})")
    return line + (f"; not run: {error}" if error else "")


def _views(entry):
    return f", through {', '.join(entry['views'])}" if entry["views"] else ""


def as_json(info):
    """What --json prints of `info`."""
    return {"file_bytes": info["file_bytes"], "initializers": info["initializers"], "vocabulary": info["vocabulary"],
            "pairs": [{k: p[k] for k in ("table", "head", "relation", "wasted_bytes", "max_error_in_scales")}
                      for p in info["pairs"]],
            "runtime_copies": info["runtime_copies"]}
