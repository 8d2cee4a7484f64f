"""--plot FILE.png: the distribution of row lengths with the longest rows named, and each query's two lists."""
import os
import tempfile


def plot(path, data, lengths):
    """Draw --json's `table` (and every row's length) to `path`, atomically; matplotlib is optional, so it is
    imported only here (the command checks for it before the run)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    queries = data["queries"]
    fig, axes = plt.subplots(1 + len(queries), 1, figsize=(10, 3.2 * (1 + len(queries))), squeeze=False)
    ax = axes[0][0]
    ax.hist(lengths, bins=120, color="#4c72b0")
    ax.set_yscale("log")
    ax.set_xlabel("row length (Euclidean norm)")
    ax.set_ylabel("rows")
    ax.set_title(f"{data['name']}: {data['vocab_size']} x {data['width']}, median length "
                 f"{data['norms']['median']:.2f}")
    for i, row in enumerate(data["longest"][:5]):
        ax.annotate(row["token"] or f"#{row['id']}", (row["norm"], 1), xytext=(row["norm"], 10 * 3 ** i),
                    arrowprops={"arrowstyle": "-", "color": "#c44e52"}, fontsize=8, ha="right", color="#c44e52")
    for ax, query in zip((a[0] for a in axes[1:]), queries):
        name = query["token"] or f"#{query['id']}"
        ax.axis("off")
        ax.set_title(f"{name}: nearest by cosine (left) and by dot product (right)", fontsize=10)
        cells = [[c["token"] or f"#{c['id']}", f"{c['score']:.3f}", d["token"] or f"#{d['id']}", f"{d['score']:.2f}",
                  f"{lengths[d['id']]:.2f}"] for c, d in zip(query["cosine"], query["dot"])]
        table = ax.table(cellText=cells, colLabels=["cosine", "score", "dot product", "score", "row length"],
                         loc="center")
        table.auto_set_font_size(False)
        table.set_fontsize(8)
    fig.tight_layout()
    fd, staged = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".writing-", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(staged, dpi=110)
        os.replace(staged, path)
    except BaseException:
        os.unlink(staged)
        raise
    finally:
        plt.close(fig)
