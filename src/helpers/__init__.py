"""Helpers for the notebook series: each is taught in a notebook first, then imported from here."""

from helpers.checkpoint import CheckpointError, Checkpoints, load_checkpoint, save_checkpoint, state_dicts_equal
from helpers.data import (LABELS, DataFileError, Example, PadToLongest, bundled_data_dir, load_examples, load_split,
                          make_loader)
from helpers.devices import has_gpus
from helpers.models import (DEFAULT_MODEL, SEED_MODEL, ModelChoice, ModelNotAvailableError, load_bert, load_tokenizer,
                            resolve_model)
from helpers.net import Net
from helpers.optim import ParamGroupError, audit_param_groups, format_param_groups, learning_rates_for, two_lr_adam
from helpers.train import evaluate, fit, input_device, time_training_step, to_device, train_epoch
from helpers.wrapping import unwrap
