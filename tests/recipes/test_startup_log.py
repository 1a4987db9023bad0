"""What rank 0 says at start-up and at the end: the model as configured, where training starts,
where the outputs are."""

from hyper_parallel.trainer import RunSummary, compose_config
from hyper_parallel.trainer.config import model_overrides
from hyper_parallel.trainer.loop import format_summary, starting_point
from hyper_parallel.trainer.operations import LoadPlan


def test_size_overrides_are_named_next_to_the_preset():
    assert model_overrides(compose_config([]).model) == {}
    cfg = compose_config(["model=llama_50m", "model.dim=32", "model.n_heads=4", "model.init_from=/x"])
    assert model_overrides(cfg.model) == {"dim": 32, "n_heads": 4}


def test_the_starting_point_names_init_from_and_checkpoints():
    cfg = compose_config(["output_dir=/o"])
    assert starting_point(cfg, None) == "starting from scratch"
    plan = LoadPlan("/o/checkpoints/step-6", ["model"], 6, "resumed from /o/checkpoints/step-6")
    assert starting_point(cfg, plan) == "resumed from /o/checkpoints/step-6"
    cfg = compose_config(["output_dir=/o", "model.init_from=/hf"])
    assert starting_point(cfg, None) == "starting at step 0 from the weights in /hf (model.init_from)"


def test_the_summary_names_the_tensorboard_folder_when_there_is_one():
    summary = RunSummary(start_step=0, end_step=2, losses=[2.0, 1.0], wall_time_s=1.0, tokens_per_s=5.0)
    assert "tensorboard" not in format_summary(summary, compose_config(["output_dir=/o"]))
    text = format_summary(summary, compose_config(["output_dir=/o", "logging.tensorboard=true"]))
    assert text.splitlines()[-1] == "tensorboard: /o/tensorboard"
