"""Every plot's titles lie inside the figure (a long DP title beside a legend was cut)."""

from __future__ import annotations

import pytest

from gradmod.reporting import plots

DP = {"frac_clipped": 0.75, "examples": 4, "calls": 2, "norm_mean": 2.375, "norm_max": 4.0}


@pytest.mark.parametrize("plot", [plots.plot_grad_norms, plots.plot_frac_clipped])
def test_dp_plot_titles_fit_the_figure(tmp_path, monkeypatch, plot):
    boxes = []
    save = plots._save

    def measure(fig, path, **kwargs):
        renderer = fig.canvas.get_renderer()
        boxes.extend((ax.title.get_window_extent(renderer), fig.bbox, ax.get_title()) for ax in fig.axes)
        save(fig, path, **kwargs)

    monkeypatch.setattr(plots, "_save", measure)
    plot([(1, {"dp/per_sample_clip": DP}), (2, {"dp/per_sample_clip": DP})], tmp_path / "p.png")
    assert boxes and (tmp_path / "p.png").stat().st_size > 0
    for box, figure, title in boxes:
        assert figure.x0 <= box.x0 and box.x1 <= figure.x1, title
        assert "per_sample rules" in title  # wrapped, not shortened
