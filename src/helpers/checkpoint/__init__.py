"""Checkpoints that survive a kill, load safely into any wrapping, and let a run continue exactly.

One mechanism for every wrapping: the model's weights and the optimizer's state go under the plain model's names
(torch.distributed.checkpoint's ``get_model_state_dict``; ``unwrap`` first removes DataParallel, DDP and
torch.compile's wrapper). Where the tensors go depends on whether the model is sharded: not sharded, rank 0 writes
``model.safetensors`` and ``state.pt``; sharded (FSDP2), every process writes its shards into ``sharded/`` and rank 0
writes ``state.pt``. Weights load into any model of the same shape, across wrappings, layouts and numbers of
processes (a sharded checkpoint into a plain ``Net``); resuming, which loads the optimizer too, needs the layout and
the number of processes that saved it. A folder of checkpoints has a text file ``latest`` naming the newest one and
``best`` naming the one with the lowest validation loss. A classifier trained on your own files carries its label
names in ``model.safetensors``'s metadata.

The contract (tests/test_checkpoint.py case by case, tests/test_checkpoint_fuzz.py on real folders of each layout):

- Loading is all or nothing. Every file is read and checked before anything changes: it is a regular file inside
  the folder, no larger than this model's, read without running code, and holds exactly what this run would have
  written (keys, types, settings, ranges). Then the model, optimizer, scheduler, gradient scaler and random state are
  loaded, each kept first, and all put back if any fails. Any bad input raises one CheckpointError that names the
  file and keeps the original exception as its cause; the caller's objects and every class of the process are then
  as they were, and no hook of theirs has run.
- Saving writes a new folder and only then points ``latest`` at it, so after a kill at any moment ``latest``
  names a checkpoint that loads. If a process fails to write, every process raises CheckpointError at once.

The modules, one job each:

- ``progress``: where a run stands (``Progress``) and its random state;
- ``weights``: a model's full weights in any wrapping, and telling weights equal;
- ``optimizer_state``: an optimizer's state under parameter names, and the state its class keeps;
- ``atomic``, ``writing``: writing files and folders that appear complete or not at all; writing a checkpoint;
- ``files``, ``shard_metadata``, ``shard_reader``: reading each file of a folder safely;
- ``validation``, ``state_format``, ``against_run``: the one way a check reports; what ``state.pt`` holds; a
  checkpoint against the run that loads it;
- ``loading``: opening (read and check) and loading (all or nothing);
- ``together``: processes that fail together; ``run_folder``: a run's folder of checkpoints and its pointers.

``state.pt`` holds one entry per part of a run (``STATE_PARTS``); another part is one more entry, written in
``save_checkpoint``, checked in ``state_format.check_state`` and ``against_run``, and loaded in
``OpenCheckpoint.apply``, as the gradient scaler of ``--amp fp16`` is.
"""

from helpers.checkpoint.files import (MODEL_FILE, SHARDED_DIR, STATE_FILE, CheckpointError, read_labels,
                                      read_state)
from helpers.checkpoint.loading import OpenCheckpoint, checkpoint_layout, load_checkpoint, open_checkpoint
from helpers.checkpoint.progress import (Progress, epoch_start_state, rng_state, set_epoch_start_state,
                                         set_rng_state, set_sampler_epoch)
from helpers.checkpoint.run_folder import Checkpoints
from helpers.checkpoint.state_format import STATE_PARTS
from helpers.checkpoint.weights import full_weights, state_dicts_equal, weights_digest
from helpers.checkpoint.writing import save_checkpoint, save_model

__all__ = ["MODEL_FILE", "SHARDED_DIR", "STATE_FILE", "STATE_PARTS", "CheckpointError", "Checkpoints",
           "OpenCheckpoint", "Progress", "checkpoint_layout", "epoch_start_state", "full_weights", "load_checkpoint",
           "open_checkpoint", "read_labels", "read_state", "rng_state", "save_checkpoint", "save_model",
           "set_epoch_start_state", "set_rng_state", "set_sampler_epoch", "state_dicts_equal", "weights_digest"]
