"""The training loop really trains, and evaluate() measures what it says."""

import copy
import functools

import pytest
import torch
from transformers import set_seed

from helpers.checkpoint import state_dicts_equal
from helpers.data import load_split, make_loader
from helpers.models import load_tokenizer
from helpers.net import Net
from helpers.optim import two_lr_adam
from helpers.train import evaluate, fit, input_device, time_training_step, train_epoch


def test_fit_lowers_the_training_loss_and_records_every_batch(capsys):
    set_seed(0)
    tokenizer = load_tokenizer()
    examples = load_split("train")[:64]
    loader = make_loader(examples, tokenizer, batch_size=16, shuffle=True)
    net = Net()
    history = fit(net, loader, loader, two_lr_adam(net, 1e-3, 1e-3), epochs=4, timed=True)
    assert [row["epoch"] for row in history] == [1, 2, 3, 4]
    assert all(len(row["batch_losses"]) == 4 for row in history)
    assert all(row["train_loss"] == sum(row["batch_losses"]) / 4 for row in history)
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2", "epoch 3", "epoch 4"]
    assert all(line.endswith(f"({row['seconds']:.1f} s)") for line, row in zip(lines, history, strict=True))


def test_evaluate_counts_correct_predictions():
    tokenizer = load_tokenizer()
    examples = load_split("validation")[:20]
    net = Net().eval()
    result = evaluate(net, make_loader(examples, tokenizer, batch_size=8))
    batch = next(iter(make_loader(examples, tokenizer, batch_size=20)))
    with torch.no_grad():
        predictions = net(batch["input_ids"], batch["attention_mask"]).argmax(-1)
    assert result["accuracy"] == (predictions == batch["labels"]).sum().item() / 20


def test_train_epoch_takes_the_sgd_steps_written_out_by_hand():
    """Two batches, SGD with lr 0.1, dropout off: after the epoch every weight is what two steps of w <- w - 0.1 x
    (gradient of the batch's mean loss) give, and each loss is its batch's loss before its step."""
    loader = make_loader(load_split("train")[:8], load_tokenizer(), 4)
    set_seed(0)
    net = Net()
    for module in net.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    by_hand, losses = copy.deepcopy(net), []
    for batch in loader:
        loss = torch.nn.functional.cross_entropy(by_hand(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for weight in by_hand.parameters():
                if weight.grad is not None:
                    weight.add_(weight.grad, alpha=-0.1)
                weight.grad = None
    assert train_epoch(net, loader, torch.optim.SGD(net.parameters(), lr=0.1)) == losses
    trained = dict(net.named_parameters())
    assert all(torch.equal(trained[name], weight) for name, weight in by_hand.named_parameters())


def test_input_device_follows_the_parameters_and_dataparallel():
    net = Net()
    assert input_device(net) == torch.device("cpu")
    assert input_device(torch.compile(net)) == torch.device("cpu")
    # Without CUDA, DataParallel keeps device_ids empty and calls the model where it is.
    parallel = torch.nn.DataParallel(net)
    assert parallel.device_ids == [] and input_device(parallel) == torch.device("cpu")
    # With GPUs it scatters the batch from device_ids[0], wherever the parameters are: DataParallel(net,
    # device_ids=[1, 0]) on a two-GPU machine sets these (only the attribute is set here; nothing runs on a GPU).
    parallel.device_ids = [1, 0]
    assert input_device(parallel) == torch.device("cuda", 1)


def test_train_epoch_and_evaluate_run_through_dataparallel_and_compile():
    tokenizer = load_tokenizer()
    loader = make_loader(load_split("train")[:8], tokenizer, 4)
    # aot_eager: TorchDynamo traces and AOTAutograd builds the backward graph, as with the default backend,
    # but no C++ is generated and compiled (that took over a minute on 2 cores and tests nothing of ours).
    compile_without_codegen = functools.partial(torch.compile, backend="aot_eager")
    for wrap in (torch.nn.DataParallel, compile_without_codegen):
        set_seed(0)
        net = Net()
        before = net.linear.weight.detach().clone()
        model = wrap(net)
        assert len(train_epoch(model, loader, two_lr_adam(net))) == 2
        assert not torch.equal(before, net.linear.weight)
        through_wrapper, unwrapped = evaluate(model, loader), evaluate(net, loader)
        assert through_wrapper["accuracy"] == unwrapped["accuracy"]  # the same 8 predictions
        assert through_wrapper["loss"] == pytest.approx(unwrapped["loss"], abs=1e-6)


def test_an_empty_loader_is_named_instead_of_dividing_by_zero():
    net = Net()
    empty = make_loader([], load_tokenizer(), batch_size=4)
    with pytest.raises(ValueError, match=r"^train_epoch: the loader yielded no batches; is its data set empty"):
        train_epoch(net, empty, two_lr_adam(net))
    with pytest.raises(ValueError, match=r"^evaluate: the loader yielded no examples; is its data set empty\?"):
        evaluate(net, empty)


def test_timing_a_step_leaves_the_training_that_follows_unchanged():
    tokenizer = load_tokenizer()
    sample = next(iter(make_loader(load_split("train")[:8], tokenizer, 8)))
    trained = []
    for timed in (False, True):
        set_seed(0)
        net = Net().eval()
        if timed:
            assert time_training_step(net, sample) > 0
            assert not net.training and all(p.grad is None for p in net.parameters())
        train_epoch(net, make_loader(load_split("train")[:16], tokenizer, 8, shuffle=True), two_lr_adam(net))
        trained.append(net.state_dict())
    assert state_dicts_equal(*trained)  # same dropout masks: the random state was given back


@pytest.mark.parametrize(("rank", "bar"), [("0", True), ("1", False)])
def test_only_rank_0_draws_the_progress_bar(capsys, monkeypatch, rank, bar):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setenv("RANK", rank)  # as torchrun sets it; helpers.distributed.rank() reads it before a group exists
    net = Net()
    train_epoch(net, make_loader(load_split("train")[:8], load_tokenizer(), 4), two_lr_adam(net))
    assert ("train:" in capsys.readouterr().err) == bar  # the bar's last refresh depends on timing: its name does not
