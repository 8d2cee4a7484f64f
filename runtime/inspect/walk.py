"""Walking the graph: one topological order (a cycle is a finding), then tables and heads found through it."""
from runtime.inspect.reading import InspectError

_VIEWS = ("Identity", "Transpose")  # ops a table may pass through on its way to a Gather, MatMul or Gemm


def _label(node):
    return node.name or (node.output[0] if node.output else node.op_type)


def check_order(graph):
    """The nodes in an order where every producer comes first (Kahn), or an InspectError naming a cycle.

    Linear in nodes plus edges; also refuses a tensor written by two nodes, which no valid ONNX graph has.
    """
    nodes = list(graph.node)
    producer = {}
    for i, node in enumerate(nodes):
        for out in node.output:
            if not out:
                continue
            if out in producer:
                raise InspectError(f"tensor {out!r} is written by both {_label(nodes[producer[out]])!r} and "
                                   f"{_label(node)!r}: not a valid ONNX graph")
            producer[out] = i
    waiting = [0] * len(nodes)
    readers = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        for name in set(node.input):
            if name in producer:
                waiting[i] += 1
                readers[producer[name]].append(i)
    ready = [i for i, n in enumerate(waiting) if n == 0]
    order = []
    while ready:
        i = ready.pop()
        order.append(nodes[i])
        for j in readers[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    if len(order) < len(nodes):
        raise InspectError(_cycle(nodes, producer, {i for i, n in enumerate(waiting) if n}))
    return order, {name: nodes[i] for name, i in producer.items()}


def _cycle(nodes, producer, stuck):
    """One line naming a cycle among the `stuck` nodes (each waits on another stuck node)."""
    seen, path, i = {}, [], min(stuck)
    while i not in seen:
        seen[i] = len(path)
        path.append(i)
        i = next(producer[n] for n in nodes[i].input if producer.get(n) in stuck)
    ring = path[seen[i]:]
    ops = sorted({nodes[j].op_type for j in ring})
    kind = f"{ops[0]} cycle" if len(ops) == 1 else f"cycle of {', '.join(ops)} nodes"
    return f"{kind} through {', '.join(_label(nodes[j]) for j in reversed(ring))}: not a valid ONNX graph"


class Resolver:
    """Follows a tensor back through Identity and 2-D Transpose to the initializer it views, memoised."""

    def __init__(self, producer, weights):
        self.producer, self.weights, self.known = producer, weights, {}

    def __call__(self, name):
        """(initializer, transposes passed) or None. Terminates: check_order has ruled out cycles."""
        chain = []
        while name not in self.known:
            if name in self.weights:
                self.known[name] = (name, 0)
                break
            node = self.producer.get(name)
            if node is None or node.op_type not in _VIEWS or not node.input:
                self.known[name] = None
                break
            flip = 0
            if node.op_type == "Transpose":
                perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
                if perm and perm[0] != [1, 0]:
                    self.known[name] = None
                    break
                flip = 1
            chain.append((name, flip))
            name = node.input[0]
        found = self.known[name]
        for step, flip in reversed(chain):
            found = None if found is None else (found[0], found[1] + flip)
            self.known[step] = found
        return found


def find_tables_and_heads(model):
    """Tables: [(initializer, Gather node)]; heads: [{initializer, node, as_table, flips}], for a checked Model."""
    graph = model.proto.graph
    order, producer = check_order(graph)
    resolve = Resolver(producer, model.tensors)
    tables, heads, seen = [], [], set()
    for node in order:
        if node.op_type == "Gather" and len(node.input) >= 2:
            found = resolve(node.input[0])
            if found and found[1] == 0 and found[0] not in seen and len(model.tensors[found[0]].dims) == 2:
                seen.add(found[0])
                tables.append((found[0], node))
        elif node.op_type in ("MatMul", "Gemm") and len(node.input) >= 2:
            found = resolve(node.input[1])
            if found and len(model.tensors[found[0]].dims) == 2:
                trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0) if node.op_type == "Gemm" else 0
                # stored as [vocab, width], like a table, when the transposes on the way and transB add up odd
                heads.append({"initializer": found[0], "node": node, "flips": found[1],
                              "as_table": (found[1] + trans_b) % 2 == 1})
    return tables, heads
