"""Turning data settings into a dataset directory: the Diabetes-130 records (synthetic, public, or the real CSV,
:mod:`raydp.data.splits`) or any table of free text (:mod:`raydp.data.text_source`)."""

from __future__ import annotations

from pathlib import Path

from raydp.data.splits import PUBLIC_SOURCE, build_dataset, load_manifest
from raydp.data.text_source import build_text_dataset


def build_from_config(data, out_dir: str | Path, overwrite: bool = False, progress: bool = True) -> dict:
    """Build ``out_dir`` from :class:`raydp.config.DataConfig` settings; returns the manifest."""
    if data.text_column is not None:
        return build_text_dataset(out_dir, source=data.source, text_column=data.text_column,
                                  unit_column=data.unit_column, seed=data.seed, n_canary=data.n_canary,
                                  canary_seed=data.canary_seed, n_audit=data.n_audit, fractions=data.fractions,
                                  sample_fraction=data.sample_fraction, overwrite=overwrite)
    source = data.source if data.source in ("synthetic", PUBLIC_SOURCE) else str(Path(data.source).expanduser())
    return build_dataset(out_dir, source=source, n_records=data.n_records, seed=data.seed, n_canary=data.n_canary,
                         canary_seed=data.canary_seed, n_audit=data.n_audit, ids_mapping=data.ids_mapping,
                         fractions=data.fractions, sample_fraction=data.sample_fraction, generator=data.generator,
                         overwrite=overwrite, progress=progress)


def resolve_dataset(data, build_dir: str | Path, progress: bool = True) -> Path:
    """The one place a run or a study turns its data settings (:class:`raydp.config.DataConfig`) into a
    dataset directory: a built dataset directory is used as is (its manifest checked); a CSV, a text table or
    the synthetic generator is built into ``build_dir`` (reused when already built there)."""
    source = Path(data.source).expanduser()
    if data.source not in ("synthetic", PUBLIC_SOURCE) and source.is_dir():
        load_manifest(source)  # validates that it is a dataset directory
        return source.resolve()
    build_dir = Path(build_dir)
    if not (build_dir / "manifest.json").exists():
        build_from_config(data, build_dir, progress=progress)
    return build_dir.resolve()
