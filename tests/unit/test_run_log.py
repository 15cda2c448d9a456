"""What keeps library noise off a run's console (issue 24, item 3): known records go to the log file, unknown
ones still reach the console; an engine start's raw output (C++ warnings, tqdm) goes to the file wholesale; a
reward model's expected load report becomes one line. vLLM itself is never imported here (see
tests/integration/test_train_ppo.py for a real run's console)."""

import logging
import os

import pytest

from openpack.distributed import run_log
from openpack.models.reward import only_a_new_head


@pytest.fixture
def noisy_logger(tmp_path):
    """A logger with one known-noise message start, its filter writing to ``tmp_path / 'run.log'``."""
    logger = logging.getLogger("openpack.test.noisy")
    noise = run_log.NoiseFilter(("Chat template warmup failed",))
    noise.file = logging.FileHandler(tmp_path / "run.log")
    logger.addFilter(noise)
    yield logger
    logger.removeFilter(noise)
    noise.file.close()


def test_known_noise_goes_to_the_log_file_and_the_rest_to_the_console(noisy_logger, tmp_path, caplog):
    try:
        raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
    except ValueError:
        noisy_logger.warning("Chat template warmup failed", exc_info=True)
    noisy_logger.warning("KV cache is too small for max_model_len 4096")
    assert [r.getMessage() for r in caplog.records] == ["KV cache is too small for max_model_len 4096"]
    logged = (tmp_path / "run.log").read_text()
    assert "Chat template warmup failed" in logged and "Traceback" in logged and "KV cache" not in logged


def test_the_noise_table_names_the_records_of_the_issue():
    """vLLM's chat-template traceback and eos notice, the rotary reload warning at every sync, the Triton notice
    of vLLM's import and Ray's token notice; keyed by the loggers that log them."""
    starts = [start for group in run_log.NOISE.values() for start in group]
    for words in ("Chat template warmup failed", "Using None for EOS token id", "RotaryEmbedding: Failed to load",
                  "Triton is installed, but doesn't include CPU backend", "Token authentication is enabled"):
        assert any(start.startswith(words) or words.startswith(start) for start in starts), words
    assert "vllm.renderers.base" in run_log.NOISE


def test_an_engine_start_writes_below_python_into_the_log_file(tmp_path, capfd):
    """File descriptors 1 and 2 (what C++ and tqdm write to) go to the file for the block, and come back after."""
    log = tmp_path / "logs" / "engine.log"
    with run_log.output_to(log):
        os.write(1, b"[W utils.cpp:68] Warning: NUMA binding\n")
        os.write(2, b"Loading safetensors checkpoint shards: 100%\n")
    os.write(1, b"step 1/2\n")
    out, err = capfd.readouterr()
    assert out == "step 1/2\n" and err == ""
    assert log.read_text() == "[W utils.cpp:68] Warning: NUMA binding\nLoading safetensors checkpoint shards: 100%\n"


def test_each_process_has_its_own_log_file(tmp_path):
    path = run_log.process_log_file(tmp_path, "vllm_engine")
    assert path.parent == tmp_path and path.name.startswith("vllm_engine-") and path.name.endswith(f"-{os.getpid()}.log")


@pytest.mark.parametrize("info, expected", [
    ({"missing_keys": {"score.weight"}, "unexpected_keys": {"lm_head.weight"}, "mismatched_keys": set()}, True),
    ({"missing_keys": {"score.weight"}, "unexpected_keys": set(), "mismatched_keys": set()}, True),  # tied head
    ({"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set()}, True),  # a reward model
    ({"missing_keys": {"score.weight", "model.norm.weight"}, "unexpected_keys": set(), "mismatched_keys": set()},
     False),
    ({"missing_keys": {"score.weight"}, "unexpected_keys": {"model.extra.weight"}, "mismatched_keys": set()}, False),
    ({"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": {("score.weight", (2, 8), (1, 8))}}, False),
])
def test_a_load_report_is_replaced_only_when_it_says_what_a_new_head_means(info, expected):
    assert only_a_new_head(info) is expected


def test_a_head_saved_under_another_prefix_is_expected_too():
    info = {"missing_keys": {"score.weight"}, "unexpected_keys": {"value_head.weight"}, "mismatched_keys": set()}
    assert only_a_new_head(info, "value_head") and not only_a_new_head(info)


def test_a_reward_model_from_a_causal_lm_says_so_in_one_line(tmp_path, caplog):
    """transformers' red "score.weight MISSING / lm_head.weight UNEXPECTED" table, logged at every start from a
    causal LM, read as a failure; it is what such a start means, so one openpack line replaces it."""
    from openpack.models.reward import load_reward_model
    from openpack.models.tiny import tiny_causal_lm

    class Kept(logging.Handler):
        records = []

        def emit(self, record):
            self.records.append(record)

    tiny_causal_lm("llama", tie_word_embeddings=False).save_pretrained(tmp_path)
    transformers_logger, kept = logging.getLogger("transformers"), Kept()  # it does not propagate to caplog's root
    transformers_logger.addHandler(kept)
    try:
        with caplog.at_level(logging.INFO):
            load_reward_model(str(tmp_path), flag="--critic_pretrain")
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
        from transformers import AutoModelForSequenceClassification

        AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=1)  # the report, without openpack
    finally:
        transformers_logger.removeHandler(kept)
    # what openpack's load logged; the plain load below reaches caplog too where an earlier test made transformers'
    # logger propagate (the whole suite in a fresh clone)
    assert said == [
        f"--critic_pretrain {tmp_path}: a causal LM, so the reward model's head (score) starts new, initialised as "
        "transformers initialises it"]
    [report] = [r.getMessage() for r in Kept.records if "LOAD REPORT" in r.getMessage()]
    assert "score.weight" in report and "MISSING" in report  # only the plain load showed it
