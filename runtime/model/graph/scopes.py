"""Each scope of a graph (the main graph and every If / Loop / Scan body) in order, with one map of
producers and consumers layered on its enclosing scopes': built once, read by every finding."""
from collections import ChainMap

from runtime.model.read.model import graph_paths, label
from runtime.model.read.text import InspectError


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
                raise InspectError(f"tensor {out!r} is written by both {label(nodes[producer[out]])!r} and "
                                   f"{label(node)!r}: not a valid ONNX graph")
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
    return f"{kind} through {', '.join(label(nodes[j]) for j in reversed(ring))}: not a valid ONNX graph"


def scopes(graph):
    """[(path, body, nodes in order, producer, consumers)] for the main graph and every If / Loop / Scan body in it
    (reading.graph_paths), each checked by check_order, a body's maps layered on its enclosing scopes' (a body reads
    outer-scope values by name; ONNX forbids it to shadow them)."""
    found, maps = [], {}
    for path, parent, g in graph_paths(graph):
        order, producer = check_order(g)
        consumers = {}
        for node in order:
            for name in dict.fromkeys(node.input):
                consumers.setdefault(name, []).append(node)
        outer = maps.get(parent, ({}, {}))
        maps[path] = ChainMap(producer, outer[0]), ChainMap(consumers, outer[1])
        found.append((path, g, order) + maps[path])
    return found
