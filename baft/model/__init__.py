"""Reference GPT decoder used by the demo, the tests and the measurement harness."""

from baft.model.gpt import GPTStage, build_stage_module, init_parameters, loss_fn, split_layers

__all__ = ["GPTStage", "build_stage_module", "init_parameters", "loss_fn", "split_layers"]
