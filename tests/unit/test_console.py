"""The console filters drop the warnings a healthy run always prints and keep the same warnings when they say
something (another missing weight, an untied tensor)."""

from __future__ import annotations

import logging

from posttrain.console import NOISE, _Drop

REPORT = ("LlamaForSequenceClassification LOAD REPORT from: tiny\nKey          | Status  | \n"
          "-------------+---------+-\n{rows}\nNotes:\n- MISSING:\tthose params were newly initialized")


def kept(logger: str, message: str) -> bool:
    record = logging.LogRecord(logger, logging.WARNING, __file__, 1, message, None, None)
    return _Drop(NOISE[logger]).filter(record)


def test_fresh_score_head_report_is_dropped_other_missing_weights_are_kept():
    assert not kept("transformers.modeling_utils", REPORT.format(rows="score.weight | MISSING | "))
    assert not kept("transformers.modeling_utils", REPORT.format(rows="score.bias   | MISSING | "))
    assert kept("transformers.modeling_utils",
                REPORT.format(rows="score.weight | MISSING | \nmodel.layers.0.mlp.up_proj.weight | MISSING | "))
    assert kept("transformers.modeling_utils", REPORT.format(rows="score.weight | UNEXPECTED | "))
    assert kept("transformers.modeling_utils", "some other warning")


def test_tied_embedding_save_note_is_dropped_untied_names_are_kept():
    message = "Removed shared tensor {names} while saving. This should be OK, but check by verifying ..."
    assert not kept("accelerate.utils.other", message.format(names="{'lm_head.weight'}"))
    assert kept("accelerate.utils.other", message.format(names="{'lm_head.weight', 'model.norm.weight'}"))


def test_vllm_reload_notes_of_the_tied_head_and_rotary_buffers_are_dropped_others_kept():
    logger = "vllm.model_executor.model_loader.reload.layerwise"
    record = logging.LogRecord(logger, logging.WARNING, __file__, 1, "%s: Failed to load weights", ("X",), None)
    for layer in ("ParallelLMHead", "RotaryEmbedding", "Llama3RotaryEmbedding"):
        record.args = (layer,)  # as vLLM logs it
        assert not _Drop(NOISE[logger]).filter(record), layer
    assert kept(logger, "QKVParallelLinear: Failed to load weights")  # a real layer that missed its weights
    assert kept(logger, "VocabParallelEmbedding: Failed to load weights")


def test_deepspeed_cpu_accelerator_note_is_dropped():
    assert not kept("DeepSpeed", "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable")
    assert kept("DeepSpeed", "Setting ds_accelerator to cuda (auto detect)")


def test_a_lone_process_takes_one_thread_unless_the_user_set_a_count(monkeypatch):
    import torch

    from posttrain.cli import one_thread_unless_asked

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        one_thread_unless_asked()
        assert torch.get_num_threads() == 2  # the user's count stands
        monkeypatch.delenv("OMP_NUM_THREADS")
        one_thread_unless_asked()
        assert torch.get_num_threads() == 1 and __import__("os").environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


def test_without_a_terminal_the_console_is_one_line_per_logging_step(tmp_path, capsys, monkeypatch):
    """As TRL's console: loss, grad norm, learning rate and the algorithm's headline metrics (DPO's accuracies and
    margins); no progress bar redrawn into a log file, the libraries' bars switched off too."""
    import subprocess
    import sys

    from posttrain.algorithms import ALGORITHMS
    from posttrain.rundir.metrics import MetricsLogger

    dpo = ALGORITHMS["dpo"][1]
    logger = MetricsLogger(str(tmp_path), 3, 0, True, headline=dpo.headline_metrics)  # pytest: stderr no terminal
    logger.log(1, {"loss": 0.69, "grad_norm": 1.5, "learning_rate": 1e-6, "rewards/accuracies": 0.5,
                   "rewards/margins": 0.01, "logps/chosen": -20.0, "tokens_per_second": 100.0})
    logger.close()
    out, err = capsys.readouterr()
    assert out == ("step 1/3 loss=0.69 grad_norm=1.5 learning_rate=1e-06 rewards/accuracies=0.5 "
                   "rewards/margins=0.01 tokens_per_second=100\n") and "\r" not in err
    code = ("import os, sys\nfrom posttrain.console import no_library_bars_without_a_terminal\n"
            "no_library_bars_without_a_terminal()\n"
            "print(os.environ.get('HF_HUB_DISABLE_PROGRESS_BARS'), os.environ.get('HF_DATASETS_DISABLE_PROGRESS_BARS'))")
    env = {k: v for k, v in __import__("os").environ.items() if "PROGRESS_BARS" not in k}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.split() == ["1", "1"]
