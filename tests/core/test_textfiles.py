"""Reading files (minibert/textfiles.py): CoNLL-U errors name the file and the line; text files split on
"\\n" only, so row i of an output is line i."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import minibert.cli
from conftest import cli_error, run_cli
from minibert import BertModel, BertTokenizer, InputError


@pytest.mark.parametrize("content,line,what", [
    ("# sent_id = 1\n1\tThe\tthe\tDET\t_\t_\t_\t_\t_\t_\n2  dog  dog  NOUN  _  _  _  _  _  _\n\n", 3, "tab"),
    ("1\tThe\tthe\tDET\t_\t_\t_\t_\t_\t_\n\n1\tA\ta\tDET\t_\t_\t_\t_\t_\t_\nx\tdog\tdog\tNOUN\t_\t_\t_\t_\t_\t_\n",
     4, "not a CoNLL-U word ID"),
    ("Just a plain text file.\nWith two lines.\n", 1, "10 tab-separated columns"),
    ("1\tThe\tthe\tDET\t_\t_\t_\t_\t_\n\n", 1, "has 9"),
])
def test_malformed_conllu_is_one_line_with_file_and_line(tmp_path, capsys, content, line, what):
    pytest.importorskip("conllu")
    from minibert.analysis.probing import read_conllu

    path = tmp_path / "bad.conllu"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(InputError, match=what) as info:
        read_conllu(path)
    assert str(info.value).startswith(f"{path}:{line}: ")
    # the CLI reads the data before loading any model: a bogus model name is never reached
    err = cli_error(capsys, "probe", str(path), "--model", str(tmp_path / "no-model"))
    assert f"{path}:{line}: " in err


def test_conllu_that_is_not_utf8_is_one_line(tmp_path, capsys):
    pytest.importorskip("conllu")
    path = tmp_path / "latin1.conllu"
    path.write_bytes("1\tcaf\xe9\t_\tNOUN\t_\t_\t_\t_\t_\t_\n\n".encode("latin-1"))
    assert "not UTF-8" in cli_error(capsys, "probe", str(path))


def test_embed_rows_are_lines_split_on_newline_only(minilm_dir, tmp_path):
    from minibert.analysis import layers as L

    texts = ["first line with a\u2028line separator inside", "second\x0cwith a form feed",
             "third\x1cwith a file separator and\x85next line", "fourth, CRLF ended", "fifth"]
    path = tmp_path / "texts.txt"
    path.write_bytes(("\n".join(texts[:3]) + "\n" + texts[3] + "\r\n" + texts[4] + "\n").encode("utf-8"))
    assert minibert.cli.read_lines(path) == texts
    out = tmp_path / "vectors"  # no suffix: .npy is added, and the printed path says so
    r = run_cli("embed", str(path), "--out", str(out), "--model", str(minilm_dir), "--quiet", "--pool", "mean")
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}.npy: 5 texts" in r.stdout
    vectors = np.load(f"{out}.npy")
    model, tok = BertModel.from_pretrained(minilm_dir), BertTokenizer.from_pretrained(minilm_dir)
    for i in (0, 2, 4):  # row i is line i
        batch = tok([texts[i]], return_tensors="pt")
        with torch.inference_mode():
            expected = L.pool(model(**batch).last_hidden_state, batch["attention_mask"], "mean")[0]
        assert np.allclose(vectors[i], expected.numpy(), atol=1e-4)
