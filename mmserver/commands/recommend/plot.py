"""``recommendation.png``: throughput and p99 against the offered load, one line per setting.
Needs matplotlib (``pip install 'mmserver[plot]'``)."""

from __future__ import annotations

from pathlib import Path

from mmserver.commands.recommend.search import SettingResult


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plot(path: Path, results: list[SettingResult], p99_ms: float) -> None:
    """Plot the open-loop runs of each setting into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    colours = plt.get_cmap("tab10")
    # A setting and the same one with one lane: the same colour, solid and dashed.
    keys = list(dict.fromkeys(_key(r) for r in results))
    for result in results:
        runs = sorted((r for r in result.runs if r.offered_rps), key=lambda r: r.offered_rps)
        if not runs:
            continue
        offered = [r.offered_rps for r in runs]
        style = {
            "color": colours(keys.index(_key(result)) % 10),
            "linestyle": "--" if result.setting.lane == "one" else "-",
            "marker": "o",
            "label": result.setting.label,
        }
        top.plot(offered, [r.rps for r in runs], **style)
        bottom.plot(
            offered, [r.p99_ms if r.p99_ms is not None else float("nan") for r in runs], **style
        )
    top.set_ylabel("answered req/s")
    top.set_title("Throughput and p99 against offered load")
    top.legend(fontsize="small")
    bottom.axhline(p99_ms, color="red", linestyle="--", label=f"target {p99_ms:g} ms")
    bottom.set_ylabel("p99 ms")
    bottom.set_xlabel("offered req/s")
    bottom.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _key(result: SettingResult) -> tuple[int, int, int]:
    setting = result.setting
    return (setting.batch_size, setting.max_batch_delay, setting.max_workers)
