"""The graphs inside a model's graph (If / Loop / Scan bodies, at any depth), named by path, and how a report names
a node: what runtime.resident and runtime.inspect both walk, kept below them both."""


def label(node):
    """How a report names a node: its name, else its first output, else its op type."""
    return node.name or (node.output[0] if node.output else node.op_type)


def graph_paths(graph):
    """[(path, parent's path or None, GraphProto)]: the main graph ("main") and every If / Loop / Scan body in it
    at any depth ("main/<node>.then_branch"; "...body[i]" where an attribute holds several), parents first."""
    found, stack = [], [("main", None, graph)]
    while stack:
        path, parent, g = stack.pop()
        found.append((path, parent, g))
        children = []
        for node in g.node:
            for a in node.attribute:
                bodies = [a.g] if a.HasField("g") else list(a.graphs)
                children += [(f"{path}/{label(node)}.{a.name}" + (f"[{i}]" if len(bodies) > 1 else ""), path, body)
                             for i, body in enumerate(bodies)]
        stack += reversed(children)
    return found
