"""Bad input at the command line: a clear message naming the file, row, flag and fix, exit code 2."""

import json

import pytest

from openpack.cli import train_sft


def run(tmp_path, pretrain, dataset, *flags):
    return train_sft.main(["--pretrain", pretrain, "--dataset", str(dataset), "--save_path", str(tmp_path / "out"),
                           "--train_batch_size", "2", "--max_steps", "1", "--launcher", "local", *flags])


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_missing_file(tmp_path, tiny_pretrain, capsys):
    assert run(tmp_path, tiny_pretrain, tmp_path / "nope.jsonl") == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_malformed_line_names_file_and_line_then_skip_counts_it(tmp_path, tiny_pretrain, capsys):
    rows = [json.dumps({"prompt": "ab", "response": "ba"})] * 3
    data = write(tmp_path / "bad.jsonl", [rows[0], "{not json", *rows[1:]])
    assert run(tmp_path, tiny_pretrain, data) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "--skip_bad_samples" in err
    assert run(tmp_path, tiny_pretrain, data, "--skip_bad_samples") == 0


def test_missing_key_names_key_and_flag(tmp_path, tiny_pretrain, capsys):
    data = write(tmp_path / "keys.jsonl", [json.dumps({"question": "ab", "response": "ba"})])
    assert run(tmp_path, tiny_pretrain, data) == 2
    err = capsys.readouterr().err
    assert "keys.jsonl:1" in err and "'prompt'" in err and "--input_key" in err


def test_empty_response(tmp_path, tiny_pretrain, capsys):
    data = write(tmp_path / "empty.jsonl", [json.dumps({"prompt": "ab", "response": "  "})])
    assert run(tmp_path, tiny_pretrain, data) == 2
    assert "empty.jsonl:1" in capsys.readouterr().err


@pytest.mark.parametrize("policy,code", [("error", 2), ("drop", 0), ("truncate", 0)])
def test_over_length_policies(tmp_path, tiny_pretrain, capsys, policy, code):
    rows = [json.dumps({"prompt": "ab", "response": "c" * 50})] + [json.dumps({"prompt": "ab", "response": "ba"})] * 2
    data = write(tmp_path / "long.jsonl", rows)
    # 32: the short rows fit with train_sft's default --input_template ('User: {}\nAssistant: ', OpenRLHF's)
    assert run(tmp_path, tiny_pretrain, data, "--max_len", "32", "--overlength_policy", policy) == code
    if policy == "error":
        err = capsys.readouterr().err
        assert "long.jsonl:1" in err and "--max_len" in err and "--overlength_policy" in err


def test_dataset_that_ends_up_empty(tmp_path, tiny_pretrain, capsys):
    data = write(tmp_path / "none.jsonl", ["{broken"])
    assert run(tmp_path, tiny_pretrain, data, "--skip_bad_samples") == 2
    assert "none.jsonl" in capsys.readouterr().err


def test_too_few_samples_for_a_step(tmp_path, tiny_pretrain, capsys):
    data = write(tmp_path / "one.jsonl", [json.dumps({"prompt": "ab", "response": "ba"})])
    assert run(tmp_path, tiny_pretrain, data) == 2
    assert "--train_batch_size" in capsys.readouterr().err


def test_bad_flag_combinations(tmp_path, tiny_pretrain, capsys):
    assert train_sft.main(["--use_dynamic_batch", "--no_packing_samples"]) == 2
    assert "--use_dynamic_batch needs --packing_samples" in capsys.readouterr().err
    assert train_sft.main(["--pretrain", tiny_pretrain]) == 2
    assert "--pretrain and --dataset together" in capsys.readouterr().err
