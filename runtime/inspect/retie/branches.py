"""A merged decoder's weights read in place: the two branches of its If on use_cache_branch read the same MatMul
weights from the main graph, and under onnxruntime's defaults each branch's kernel prepacks its own copy (the
original is freed once both have), so every weight the branches share is held twice. Read through graphs.tie's
run-time view, no kernel prepacks it: each weight is held once, mapped from the data file, and each MatMul computes
what the export's computes with prepacking off, bit for bit (the proof's reference then)."""
from dataclasses import dataclass

from onnx import helper

from graphs.tie import unfolded_view
from runtime.model.graph.ops import PLAIN_MATMULS
from runtime.model.graph.weights import matmul_weights, shared_weights
from runtime.model.read.model import graph_paths
from runtime.inspect.retie.edits import const, unique_name

_READ_IN_PLACE = PLAIN_MATMULS + ("FusedMatMul",)  # and onnxruntime's fusion of them; another packing kernel vetoes


def why_not(model, prepacked, shared):
    """Why a file's weights are not read in place (None: they are, and read_in_place may run): no weight shared by
    two graphs (`shared`: shared_weights'), or a kernel other than MatMul's prepacks in it (`prepacked`: what
    inspect found its kernels prepack; the proof's reference, the export with prepacking off, would then differ
    from the retied file in more than the weights)."""
    if not shared:
        return "no MatMul weight is read in two graphs"
    own = sorted({node.input[1] for _, _, graph in graph_paths(model.proto.graph)[1:]
                  for names in [{t.name for t in graph.initializer}] for node in graph.node
                  if node.op_type in PLAIN_MATMULS and len(node.input) > 1 and node.input[1] in names})
    if own:
        return f"a branch holds MatMul weights of its own ({own[0]})"
    others = sorted({p["kernel"] for p in prepacked if p["kernel"] not in _READ_IN_PLACE})
    if others:
        return f"its {', '.join(others)} kernels prepack too"
    return None


def read_in_place(model, shared=None):
    """Make every MatMul and Gemm of `model` (every graph) that reads a float32 initializer as its weight read it
    through a run-time view: one graphs.tie chain per graph, its run-time zero added to each shape's dims, and a
    Reshape (an alias, no copy) before each node. The chain is anchored on the model's first input (computed at
    run time whatever the graph holds, so nothing folds it) and placed first in each graph, before every reader in
    whatever order the graph lists them; a model without inputs anchors it on the first reader's other input.
    Returns ({initializer: bytes} of those the graphs shared (shared_weights), the copies the defaults no longer
    make; undo(), which puts the model back as it was). `shared`: shared_weights(model), where already found."""
    shared = shared_weights(model) if shared is None else shared
    base, number = unique_name(model, "retie_weight"), 0
    inserted, repointed, constants_before = [], [], len(model.proto.graph.initializer)
    anchor = next((i.name for i in model.proto.graph.input if i.name not in model.tensors), None)
    for _, _, graph in graph_paths(model.proto.graph):
        chain, targets = None, {}
        for node, name in list(matmul_weights(graph, model)):
            dims = tuple(model.tensors[name].dims)
            prefix, number = f"{base}{number}_", number + 1  # no name of the model starts with `base`
            at = list(graph.node).index(node)
            if chain is None:  # the graph's first: the whole chain, its `nothing` the others' too
                nodes, constants, _ = unfolded_view(name, anchor or node.input[0], list(dims), prefix + "weight",
                                                    prefix)
                for constant, values in constants.items():  # in the main graph, read from outside by a branch
                    const(model.proto.graph, constant, values)
                chain, targets[dims] = prefix, prefix + "target"
                at = 0 if anchor else at
            else:
                nodes = []
                if dims not in targets:  # another shape: its dims + the chain's run-time zero
                    targets[dims] = prefix + "target"
                    nodes.append(helper.make_node("Add", [const(model.proto.graph, prefix + "dims", dims),
                                                          chain + "nothing"], [prefix + "target"],
                                                  name=prefix + "target"))
                nodes.append(helper.make_node("Reshape", [name, targets[dims]], [prefix + "weight"],
                                              name=prefix + "view"))
            for offset, new in enumerate(nodes):
                graph.node.insert(at + offset, new)
            inserted += [(graph, new) for new in nodes]
            repointed.append((node, name))
            node.input[1] = prefix + "weight"

    def undo():
        for node, name in repointed:
            node.input[1] = name
        for graph, new in inserted:  # each name is new to the model, so == finds that node alone
            graph.node.remove(new)
        del model.proto.graph.initializer[constants_before:]  # the chains' constants, appended last

    return {name: model.tensors[name].nbytes for name in shared}, undo


@dataclass
class Shared:
    """The weights a merged decoder's branches share, now read in place ({initializer: bytes}; empty: none), and
    what the proof found of the file's other outputs against the export run under onnxruntime's defaults, whose
    kernels still prepack them (proof._drift's; None until proven), and of its heads' outputs (agree.heads_found's;
    None until proven)."""
    sizes: dict
    drift: dict | None = None
    heads: dict | None = None

    def __bool__(self):
        return bool(self.sizes)


def in_place(model, found, say):
    """read_in_place(model) where why_not finds no reason against it (the reason said, where weights are shared):
    (Shared of the weights now read in place, or of none; undo())."""
    shared = shared_weights(model)  # the model as it is now: retied
    why = why_not(model, found.prepacked, shared)
    if why is None:
        sizes, undo = read_in_place(model, shared)
        return Shared(sizes), undo
    if shared:
        say(f"retie: the weights its branches share are left as they are ({why})\n")
    return Shared({}), lambda: None
