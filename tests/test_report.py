"""``canon-titan report``: curves of several runs in one PNG (opened and inspected here) and a
self-contained HTML page with the last values."""

import base64
import re

import numpy as np
import pytest
from PIL import Image

from canon_titan.cli import main
from canon_titan.evaluation.report import read_run


def write_run(folder, description, losses, evals, tokens_per_step):
    from torch.utils.tensorboard import SummaryWriter

    (folder / "tb" / "20260101-0000").mkdir(parents=True)
    (folder / "run_config.toml").write_text(
        f'[job]\ndescription = "{description}"\n\n[metrics]\nsave_tb_folder = "tb"\n'
    )
    writer = SummaryWriter(str(folder / "tb" / "20260101-0000"))
    for step, loss in losses.items():
        writer.add_scalar("loss_metrics/global_avg_loss", loss, step)
        writer.add_scalar("n_tokens_seen", step * tokens_per_step, step)
    for (tag, step), value in evals.items():
        writer.add_scalar(tag, value, step)
    writer.add_scalar("eval/seconds", 3.0, 10)
    writer.close()


@pytest.fixture
def runs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(
        a,
        "Llama",
        {s: 6 - 0.4 * s for s in range(1, 11)},
        {("eval/depo1/accuracy", 5): 0.1, ("eval/depo1/accuracy", 10): 0.2},
        1000,
    )
    write_run(
        b,
        "LlamaCanon",
        {s: 6 - 0.5 * s for s in range(1, 11)},
        {
            ("eval/depo1/accuracy", 5): 0.3,
            ("eval/depo1/accuracy", 10): 0.9,
            ("eval/tiny_ppl/bits_per_byte", 10): 4.5,
        },
        2000,
    )
    return a, b


def test_report_png_shows_every_run_and_html_embeds_it(runs, tmp_path):
    png, page = tmp_path / "out" / "report.png", tmp_path / "out" / "report.html"
    png.parent.mkdir()
    assert main(["report", *map(str, runs), "--out", str(png), "--html", str(page)]) == 0

    image = np.asarray(Image.open(png).convert("RGB")).astype(int)
    assert image.shape[1] >= 800 and image.shape[0] >= 300
    assert image.std() > 5 and len(np.unique(image.reshape(-1, 3), axis=0)) > 50  # not blank
    # Matplotlib's first two line colours (one per run) are drawn.
    for colour in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):
        assert (np.abs(image - colour).sum(-1) < 30).sum() > 100, colour

    text = page.read_text()
    embedded = re.search(r"src='data:image/png;base64,([^']+)'", text).group(1)
    assert base64.b64decode(embedded) == png.read_bytes()
    # Last values: the run's last step and tokens, accuracy in percent as the eval commands print
    # it.
    assert "<th>last step</th><th>tokens</th><th>loss</th><th>depo1/accuracy (%)</th>" in text
    assert "<tr><td>LlamaCanon</td><td>10</td><td>20,000</td><td>1</td><td>90</td>" in text
    assert "seconds" not in text  # bookkeeping tags are not panels


def test_a_run_that_logged_once_is_drawn_and_dated(tmp_path):
    """One logged loss (a run shorter than log_freq used to log only step 1): a marker, not an empty
    panel; the table says which step that value is from."""
    from canon_titan.evaluation.report import last_values

    one = tmp_path / "one"
    write_run(one, "short", {1: 7.0}, {("eval/depo1/accuracy", 30): 0.5}, 1000)
    png = tmp_path / "one.png"
    assert main(["report", str(one), "--out", str(png)]) == 0
    image = np.asarray(Image.open(png).convert("RGB")).astype(int)
    width = image.shape[1]
    loss_panel = image[:, : width // 2]
    assert (
        np.abs(loss_panel - (0x1F, 0x77, 0xB4)).sum(-1) < 30
    ).sum() > 10  # the marker, in the run's colour
    header, rows = last_values([read_run(one)])
    assert header[:3] == ["run", "last step", "tokens"] and rows[0][:4] == [
        "short",
        "30",
        "30,000",
        "7 (step 1)",
    ]


def test_tokens_axis_and_panels(runs):
    a = read_run(runs[0])
    assert a.label == "Llama"
    assert a.tokens_at([5, 10, 12]) == [5000.0, 10000.0, 12000.0]  # interpolated, then extrapolated


def test_bad_inputs(tmp_path, runs, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")]) == 2
    assert "empty: no TensorBoard event files" in capsys.readouterr().err
    assert (
        main(["report", *map(str, runs), "--labels", "one", "--out", str(tmp_path / "x.png")]) == 2
    )
    assert "--labels has 1 names for 2 runs" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_loss_smoothing_is_a_debiased_ema():
    from canon_titan.evaluation.report import _ema

    assert _ema([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 5 / 3, 17 / 7])  # by hand
    assert _ema([4.0] * 5, 0.9) == pytest.approx([4.0] * 5)  # no pull towards 0 or the first value


def test_validation_curves_of_two_runs_against_tokens_seen(tmp_path):
    """A panel of ``[validation]``'s loss, after the training loss: each run's points at the tokens
    it had seen at their steps (1,000 and 2,000 tokens a step), read back from the figure."""
    from canon_titan.evaluation.report import figure, last_values

    a, b = tmp_path / "a", tmp_path / "b"
    write_run(
        a,
        "Llama",
        {s: 6 - 0.4 * s for s in range(1, 11)},
        {("validation/loss", 5): 4.5, ("validation/loss", 10): 4.25},
        1000,
    )
    write_run(
        b,
        "LlamaCanon",
        {s: 6 - 0.5 * s for s in range(1, 11)},
        {("validation/loss", 4): 4.0, ("validation/loss", 8): 3.5},
        2000,
    )
    runs = [read_run(a), read_run(b)]
    fig = figure(runs)
    assert [ax.get_title() for ax in fig.axes[:2]] == ["training loss", "validation loss"]
    curves = {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in fig.axes[1].get_lines()
    }
    assert curves == {
        "Llama": ([5000.0, 10000.0], [4.5, 4.25]),
        "LlamaCanon": ([8000.0, 16000.0], [4.0, 3.5]),
    }
    header, rows = last_values(runs)
    assert header[3:5] == ["loss", "validation loss"] and rows[1][4] == "3.5 (step 8)"
