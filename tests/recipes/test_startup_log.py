"""What rank 0 says at start-up and at the end: the model as configured, where training starts,
where the outputs are."""

from hyper_parallel.trainer import RunSummary, compose_config
from hyper_parallel.trainer.config.compose import model_overrides
from hyper_parallel.trainer.launch.reporting import format_summary, starting_point
from hyper_parallel.trainer.checkpointing.operations import LoadPlan


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


def test_the_start_up_line_names_the_float8_recipe_and_the_pipeline_schedule():
    from hyper_parallel.trainer import ParallelDims, typed_config
    from hyper_parallel.trainer.launch.reporting import layout

    def line(overrides, dims):
        return layout(typed_config(compose_config(overrides)), dims)

    assert line([], ParallelDims(1, 2)) == "mesh 2 (shard), fp32"
    assert line(["training.float8=true"], ParallelDims(1, 2)) == "mesh 2 (shard), fp32 with float8 tensorwise linears"
    assert (line(["training.float8=true", "training.float8_recipe=rowwise", "parallel.mixed_precision=bf16"],
                 ParallelDims(2, 2)) == "mesh 2x2 (replicate, shard), bf16 with float8 rowwise linears")
    assert (line(["parallel.pp=2", "parallel.pp_schedule=GPipe", "parallel.pp_microbatches=4",
                  "training.grad_accum_steps=2"], ParallelDims(1, 2, 1, 2))
            == "mesh 2x2 (pp, shard), pipeline GPipe with 4 micro-batches per accumulation step, fp32")
    assert (line(["parallel.pp=2"], ParallelDims(1, 1, 2, 2))
            == "mesh 2x1x2 (pp, shard, tp), pipeline 1F1B with 4 micro-batches, fp32")
