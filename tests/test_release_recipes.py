"""``[model] seed`` initialises the weights of a real run."""

import torch

from canon_titan.config import load
from conftest import COMMON, CONFIGS, run_training
from test_convert import dcp_tensors


def test_model_seed_initialises_the_weights(tmp_path):
    """A run's initial weights come from [model] seed, not [job] seed: they equal the model built and
    initialised by hand after torch.manual_seed([model] seed)."""
    run_training(1, COMMON + ["--job.dump_folder", str(tmp_path), "--checkpoint.enable",
                              "--checkpoint.create_seed_checkpoint", "--model.seed", "5", "--job.seed", "9"],
                 config=CONFIGS["llama_canon"])
    saved = dcp_tensors(tmp_path / "checkpoint" / "step-0")
    run = load(CONFIGS["llama_canon"], COMMON, environment=False)
    for seed, same in ((5, True), (9, False)):
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = run.model_spec().model.build()
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_states()
        assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items()) == same
