"""What a head's product reaches: the graph output it becomes through views, a soft cap, a bias or a scale, or
None (a weight of a table's shape inside a layer)."""
from runtime.model.graph.ops import CARRIES, SCALES


def _a_scale(name, producer, depth=8):
    """Whether `name` is a constant, or a product of constants and a DynamicQuantizeLinear's scale (an integer
    matmul's output is multiplied by its input's scale): not the hidden state a layer adds to its product."""
    node = producer.get(name)
    if node is None or node.op_type == "Constant":
        return True
    if node.op_type == "DynamicQuantizeLinear":
        return len(node.output) > 1 and name == node.output[1]
    return depth > 0 and node.op_type in SCALES + ("Cast", "Reshape", "Identity") and all(
        _a_scale(i, producer, depth - 1) for i in node.input if i)


class ScoredOutputs:
    """ScoredOutputs(producer, consumers, body)(node): the output of its graph `body` that the product of head `node`
    reaches (a branch's output is the If's) through views, Tanh / Softcap and a bias or scale only, or None: a logits
    head, not a weight of a table's shape inside a layer (whose product meets the hidden state on its way out, a
    residual Add or a norm, or is transposed into attention heads: a key or value projection to a present output).
    One walk of the scope for every head: what each tensor reaches is found once and remembered, so n heads whose
    products are n outputs cost n steps, not n walks (a depth-first search, the last reader first)."""

    def __init__(self, producer, consumers, body):
        self.producer, self.consumers = producer, consumers
        self.outputs, self.known = {o.name for o in body.output}, {}

    def _onward(self, step, name):
        if step.op_type in SCALES:
            return all(_a_scale(other, self.producer) for other in step.input if other != name)
        return step.op_type in CARRIES  # not Transpose: a key or value projection's way to attention

    def _next(self, name):
        return [n.output[0] for n in self.consumers.get(name, []) if n.output and self._onward(n, name)]

    def __call__(self, node):
        if not node.output:
            return None
        todo, known = [(node.output[0], None)], self.known  # (tensor, its onward tensors once expanded)
        while todo:
            name, onward = todo[-1]
            if name in known:
                todo.pop()
            elif name in self.outputs:
                known[name] = name
                todo.pop()
            elif onward is None:  # first visit: its onward tensors are walked before it is settled
                onward = self._next(name)
                todo[-1] = (name, onward)
                todo += [(n, None) for n in onward if n not in known]
            else:  # the first output the last reader reaches, as a depth-first walk meets it
                known[name] = next((known[n] for n in reversed(onward) if known.get(n)), None)
                todo.pop()
        return known[node.output[0]]
