"""Train a Fourier neural operator on Darcy flow with every sample split over ranks.

    torchrun --standalone --nproc-per-node 4 examples/fno_darcy.py                   # (ddp 2, domain 2) mesh, DDP
    torchrun --standalone --nproc-per-node 4 examples/fno_darcy.py --strategy fsdp2 --domain-size 4
    torchrun --standalone --nproc-per-node 4 examples/fno_darcy.py --resume          # continue the last run
    python examples/fno_darcy.py --steps 20                                           # one process, same code
    torchrun --standalone --nproc-per-node 4 examples/fno_darcy.py --model plain      # without neuraloperator

The same data, pipes, loss, evaluation and plots as ``unet_darcy.py`` (imported
from it: the synthetic Darcy set written once to HDF5, read through
``datapipes`` with each sample's rows split over the ``"domain"`` ranks); only
the model differs. It is neuraloperator's ``FNO`` (the ``spectral`` extra:
``pip install -e '.[spectral]'``), imported unchanged, or without it
``spectral_models.FNO2d``, a small FNO written the way public implementations
write it. Neither knows about ranks: ``torch.fft.rfft2`` on a row-sharded
ShardTensor transposes the data (one all-to-all) so the rows are whole, the
modes are truncated and mixed on the frequency columns each rank holds, and
``irfft2`` transposes back (one all-to-all): no rank ever holds a whole sample
or its whole spectrum. neuraloperator's ``SpectralConv`` allocates its spectrum
with a plain ``torch.zeros`` of the global shape, so its FNO trains under
``physicsnemo_dp.integrations.neuraloperator()``, which allocates that buffer
sharded like the spectrum (without it: the same losses, but every rank holds the
whole spectrum and gathers the written modes). Weights are plain tensors (complex
ones for the spectral layers), wrapped by DDP or FSDP2 on the ddp axis.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util

import torch
from torch import nn

from physicsnemo_dp import integrations
from physicsnemo_dp.distributed import MeshContext

import _common
import _flags
import unet_darcy
from spectral_models import FNO2d


@functools.cache
def _neuraloperator_fno() -> type[nn.Module]:
    """neuraloperator's ``FNO`` with this example's capability declaration (its code is untouched)."""
    from neuralop.models import FNO

    class NeuralOperatorFNO(FNO):
        """neuraloperator's FNO; ``ModelCapabilities`` as verified by ``tests/spectral/test_neuralop.py``.

        neuraloperator adds its constructor arguments (functions among them)
        to ``state_dict()`` under ``"_metadata"``. ``physicsnemo_dp.checkpoint``
        stores tensors and JSON values only (nothing may run when a checkpoint
        loads), and this script rebuilds the model from its flags, so the
        entry is left out; neuraloperator's ``load_state_dict`` accepts a state
        without it.
        """

        ModelCapabilities = FNO2d.ModelCapabilities

        def state_dict(self, *args, **kwargs):
            state = super().state_dict(*args, **kwargs)
            state.pop("_metadata", None)
            return state

    return NeuralOperatorFNO


def model_kind(choice: str) -> str:
    """``neuralop`` or ``plain``: ``auto`` picks neuraloperator's FNO when the package is installed."""
    if choice == "auto":
        return "neuralop" if importlib.util.find_spec("neuralop") is not None else "plain"
    return choice


def make_model(args: argparse.Namespace) -> nn.Module:
    """The FNO of ``--model`` (1 input channel, permeability; 1 output, pressure)."""
    modes = (args.modes, args.modes)
    if model_kind(args.model) == "neuralop":
        return _neuraloperator_fno()(n_modes=modes, in_channels=1, out_channels=1, hidden_channels=args.width,
                                     n_layers=args.layers)
    return FNO2d(c_in=1, c_out=1, width=args.width, modes=modes, layers=args.layers)


def parse_args(argv=None) -> argparse.Namespace:
    parser = _common.training_parser(__doc__, steps=60, batch_size=8, lr=1e-2, out="outputs/fno_darcy")
    model = unet_darcy.add_data_arguments(parser)
    model.add_argument("--model", choices=["auto", "neuralop", "plain"], default="auto",
                       help="neuralop: neuraloperator's FNO (the spectral extra); plain: spectral_models.FNO2d; "
                            "auto: neuralop if installed")
    model.add_argument("--width", type=_flags.integer(1), default=32, help="channels of the Fourier layers")
    model.add_argument("--modes", type=_flags.integer(1), default=12, help="Fourier modes kept per transformed dim")
    model.add_argument("--layers", type=_flags.integer(1), default=4, help="Fourier layers")
    return parser.parse_args(argv)


def run(argv=None, context: MeshContext | None = None) -> dict:
    """Train, test and plot; returns the run's result (see ``_common.close_run``)."""
    args = parse_args(argv)
    kind = model_kind(args.model)
    adapter = integrations.neuraloperator() if kind == "neuralop" else contextlib.nullcontext()
    with adapter, _common.open_run(args, context, "fno-darcy",
                                   f"grid {args.grid}x{args.grid}, model {kind}, modes {args.modes}") as (
            context, out, log):
        train, test = unet_darcy.prepare_data(args, out)
        train_pipe, test_pipe, normalize = unet_darcy.make_pipes(args, context, train, test)
        model, optimizer, scheduler = _common.build_training(args, context, lambda: make_model(args), torch.optim.Adam)
        losses = _common.fit(context, model, optimizer, scheduler, train_pipe, unet_darcy.loss_fn, args, out, log)
        test_loss, sample = unet_darcy.evaluate(model, test_pipe, normalize, context)
        log.info(f"test loss (normalized pressure, {len(test_pipe) * context.ddp_size} samples): {test_loss:.6g}")
        return _common.close_run(
            context, args, out, log, title=f"FNO ({kind}) on Darcy flow", losses=losses, test_loss=test_loss,
            plot_prediction=lambda path: unet_darcy.plot_sample(path, sample),
            pipes=(train_pipe, test_pipe), model=model, optimizer=optimizer,
        )


if __name__ == "__main__":
    raise SystemExit(_common.main(run))
