"""progress(): a tqdm bar on stderr that yields the wrapped items."""

import quilt


def test_progress_yields_items_and_writes_to_stderr(capsys):
    bar = quilt.progress(range(3), desc="train")
    items = []
    for item in bar:
        items.append(item)
        bar.set_postfix(loss=0.5)
    captured = capsys.readouterr()
    assert items == [0, 1, 2]
    assert "train" in captured.err and captured.out == ""
