"""Forward-pass local DP strategies: ``ewft`` (EW-FT, Sec. 4-5) and its baseline ``dpforward`` (DP-Forward).

These strategies do not set the dials of the DP-SGD step: they choose a LOCAL mechanism on the hidden
embeddings (:mod:`raydp.privacy.forward`), run by the same loop, on the same data and task, with the
same ledger, reports and attacks. What each chooses:

* ``ewft``: the noise layer after block ``layer``, a stacked autoencoder (``autoencoder``: its sizes,
  trained on public records) and EWPBA's epoch-wise noise schedule (Algorithm 1, step distance S; its
  shape, computed as in the paper with the subsampled PRV composition, then scaled so the LOCAL
  accounting lands on the target: ERRATA E8).
* ``dpforward``: the same layer with no autoencoder and a uniform schedule (the paper's baseline,
  Tables 6-7).

Both clip each example's (encoded) hidden states to Frobenius norm ``clip`` (the paper's C = 1), protect
the class labels by k-ary randomized response with ``label_share`` of the budget (basic composition
share; 0 leaves the labels unprotected, which every output then says), and take exactly
``records_per_patient`` training records from each patient (ERRATA E11: a patient's cost composes over
their records, and the receiver counts the releases it gets, so the count must not depend on the patient).
The guarantee is computed by :mod:`raydp.privacy.local`; the paper's subsampled figure is reported beside
it, labelled.
"""

from __future__ import annotations

from pydantic import Field

from raydp.settings import StrictModel

LOCAL = "local"


class ForwardSettings(StrictModel):
    layer: int | None = Field(None, ge=0, description="the noise layer follows this block (0-based; default: the "
                                                       "middle block, n_blocks // 2 - 1)")
    clip: float = Field(1.0, gt=0, description="C of Eq. 11: each example's hidden states clipped to Frobenius norm C")
    label_share: float = Field(0.25, ge=0, lt=1, description="share of epsilon spent on randomized-response labels "
                                                            "(0: labels unprotected, labelled)")
    records_per_patient: int = Field(1, ge=1, description="training records each patient contributes, exactly "
                                     "(their first ones, repeated if they have fewer; ERRATA E11)")
    autoencoder_steps: int = Field(300, ge=1, description="public reconstruction steps of the autoencoder")
    public_records: int = Field(256, gt=0, description="public records the autoencoder is fitted on")


class EWFTSettings(ForwardSettings):
    autoencoder: list[int] = Field(default_factory=lambda: [8], min_length=1,
                                   description="encoder sizes after the hidden width, e.g. [32, 8] (paper: [64] at "
                                               "BERT width 768, d = 4 in most experiments)")
    step_distance: int = Field(2, ge=1, description="S of EWPBA (Eq. 9-10; the paper's best: 2)")


class DPForwardSettings(ForwardSettings):
    pass


class ForwardStrategy:
    """A local mechanism's choices (not a DP-SGD :class:`~raydp.strategies.base.Strategy`)."""

    name = "forward"
    mechanism = LOCAL
    adaptive_sigma = False
    clip_mode = "local"
    allocation = "local"
    privacy_mode = "strict"  # the record; it observes no statistics
    raw_statistics = False
    settings_model = ForwardSettings

    def __init__(self, settings=None, clip: float | None = None):
        self.settings = settings if settings is not None else self.settings_model()

    @property
    def autoencoder_dims(self) -> tuple[int, ...] | None:
        return None

    def multipliers(self, epsilon: float, delta: float, q: float, epochs: int, steps_per_epoch: int
                    ) -> tuple[float, ...]:
        """The schedule's shape, one multiplier per epoch (the scale is calibrated by the local accounting)."""
        return (1.0,) * epochs

    def describe(self) -> dict:
        return {"name": self.name, "mechanism": "forward-pass local DP on hidden embeddings",
                "settings": self.settings.model_dump()}


class DPForwardStrategy(ForwardStrategy):
    """DP-Forward: noise layer without autoencoder, uniform noise over epochs."""

    name = "dpforward"
    settings_model = DPForwardSettings


class EWFTStrategy(ForwardStrategy):
    """EW-FT: autoencoder, clip, EWPBA's epoch-weighted schedule."""

    name = "ewft"
    settings_model = EWFTSettings

    def __init__(self, settings=None, clip: float | None = None):
        super().__init__(settings)
        self.ewpba = None

    @property
    def autoencoder_dims(self) -> tuple[int, ...] | None:
        return tuple(self.settings.autoencoder)

    def multipliers(self, epsilon: float, delta: float, q: float, epochs: int, steps_per_epoch: int
                    ) -> tuple[float, ...]:
        from raydp.privacy.ewpba import ewpba

        # EWPBA's shape as the paper computes it (subsampled composition at q = B/|D|, Alg. 1 and 3)
        self.ewpba = ewpba(epsilon, delta, q, epochs=epochs, steps_per_epoch=steps_per_epoch,
                           step_distance=self.settings.step_distance)
        return tuple(self.ewpba.multipliers())

    def describe(self) -> dict:
        out = super().describe()
        if self.ewpba is not None:
            out["ewpba"] = self.ewpba.describe()
        return out
