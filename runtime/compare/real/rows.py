"""A float32 table as embed.py reads it, a row at a time."""
import embed


class Rows:
    """`values` (float32 [vocab, width]) as a sequence of rows, each a new list of Python floats made when it is
    asked for (exact: every float32 is a double). The pure-Python reference walks a real table this way without
    holding it as Python floats: 151936 x 896 of them would be 4 GB. `stretch` / `factor`: that one row is
    embed.stretch_row's, the others are the table's."""

    def __init__(self, values, stretch=None, factor=None):
        self.values, self.stretch, self.factor = values, stretch, factor

    def __len__(self):
        return len(self.values)

    def __getitem__(self, token_id):
        if not isinstance(token_id, int) or not 0 <= token_id < len(self.values):
            raise IndexError(f"row {token_id!r} of a table of {len(self.values)} rows")
        row = self.values[token_id].tolist()
        if token_id == self.stretch:
            return embed.stretch_row([row], 0, self.factor)[0]
        return row

    def __iter__(self):
        return (self[t] for t in range(len(self.values)))

    def stretched(self, token_id, factor):
        """These rows with row `token_id` times `factor` (embed.stretch_row's rule, on that row alone)."""
        return Rows(self.values, token_id, factor)
