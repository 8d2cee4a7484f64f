"""The hidden vectors a proof compares, made outputs of the model it runs: a head's input shown even inside a merged
decoder's If branch."""
import onnx
from onnx import helper

from runtime.model.read.model import graph_paths


def shown_copy(proto, names):
    """with_outputs on a copy of `proto` (left as it is): (the copy, {name: the output that shows it})."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    return with_outputs(model, names)


def with_outputs(model, names):
    """`model` also outputting `names` (the hidden vectors the heads read), and {name: the output that shows it}. A
    name inside an If branch (a merged decoder's head) becomes a new output of that branch and of its If node, the
    other branch giving an empty tensor of the same type in its place: the run shows it when its branch ran."""
    present = {o.name for o in model.graph.output}
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v for _, _, g in graph_paths(inferred.graph) for v in list(g.value_info) + list(g.input) +
             list(g.output)}
    known.update({v.name: v for v in model.graph.input})
    branches = _branches(model.graph)
    shown = {}
    for name in names:
        if name in present:
            shown[name] = name
            continue
        if name not in known:
            raise ValueError(f"shape inference does not type {name!r}, the input or output of a head")
        homes = [b for b in branches if any(name in n.output for n in b[0].node)]
        if not homes:  # the main graph's
            model.graph.output.append(known[name])
            shown[name] = name
            continue
        elem = known[name].type.tensor_type.elem_type
        out = f"proof_shows_{len(shown)}_{name}"
        for node in {id(n): n for _, n, _ in homes}.values():  # Optimum's branches may both write the name
            if node not in model.graph.node:
                raise ValueError(f"{name!r} lies in a branch of a branch: not shown by this proof")
            for body, _, _ in (b for b in branches if b[1] is node):
                if any(name in n.output for n in body.node):  # its own value
                    body.node.append(helper.make_node("Identity", [name], [out + "_value"]))
                else:  # the other branch: an empty tensor of the same type in its place
                    empty = helper.make_tensor("empty", elem, [0], [])
                    body.node.append(helper.make_node("Constant", [], [out + "_value"], value=empty))
                body.output.append(helper.make_tensor_value_info(out + "_value", elem, None))
            node.output.append(out)
        model.graph.output.append(helper.make_tensor_value_info(out, elem, None))
        shown[name] = out
    return model, shown


def _branches(graph):
    """[(branch, its If node, the other branch)] for every If node of `graph` and of its branches."""
    found, stack = [], [graph]
    while stack:
        g = stack.pop()
        for node in g.node:
            if node.op_type == "If":
                bodies = {a.name: a.g for a in node.attribute if a.HasField("g")}
                if {"then_branch", "else_branch"} <= set(bodies):
                    then, other = bodies["then_branch"], bodies["else_branch"]
                    found += [(then, node, other), (other, node, then)]
                    stack += [then, other]
    return found
