"""The table of predictions notebook 08 and its solutions read, stored: three models under DDP and FSDP2 on 2, 4 and
8 GPUs (08), and FSDP2's levers (solutions 08, exercise 5). Computing it takes a few minutes of traces, so the
notebooks read the stored file and 08 recomputes one entry (tests recompute one of its entries).

    python -m helpers.memory.fsdp2_table      # recompute the stored table
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

from helpers.memory.configs import MODELS
from helpers.memory.formulas import parameters
from helpers.memory.fsdp2 import LEVERS, predict_fsdp
from helpers.memory.gpu_facts import GPUS
from helpers.memory.prediction import per_device

TABLE = Path(str(files("helpers") / "data" / "fsdp_memory" / "predictions.json"))


def predict_ddp(config, batch_size: int, seq_len: int) -> dict[str, int]:
    """Each DDP rank's predicted peak at a per-rank batch of ``batch_size`` on an H200 (notebook 05's prediction:
    replayed into the simulated allocator)."""
    return per_device(config, 2 * batch_size, seq_len, strategy="ddp", gpus=2, gpu=GPUS["H200"], environ={})[0]


def build_table(batch_size: int = 8, seq_len: int = 512, gpus=(2, 4, 8), lever_model: str = "BERT-large",
                lever_gpus: int = 8) -> dict:
    """Every prediction notebook 08 and its solutions show: three models under DDP and FSDP on ``gpus``, and the levers, on an
    H200 with none of the workspace variables set."""
    table = {"batch_size": batch_size, "seq_len": seq_len, "models": {}, "levers": {}}
    for name, make in MODELS.items():
        config = make()
        table["models"][name] = {"parameters": parameters(config), "ddp": predict_ddp(config, batch_size, seq_len),
                                 "fsdp": {str(n): predict_fsdp(config, batch_size, seq_len, n, environ={})
                                          for n in gpus}}
    config = MODELS[lever_model]()
    table["levers"] = {"model": lever_model, "gpus": lever_gpus,
                       "fsdp": {lever: predict_fsdp(config, batch_size, seq_len, lever_gpus, lever, environ={})
                                for lever in LEVERS}}
    return table


def load_table(path: Path = TABLE) -> dict:
    """The stored predictions (``python -m helpers.memory.fsdp2_table`` writes them)."""
    return json.loads(path.read_text(encoding="utf-8"))


if __name__ == "__main__":
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    TABLE.write_text(json.dumps(build_table(), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {TABLE}")
