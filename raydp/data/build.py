"""Turning data settings into a dataset directory: the Diabetes-130 records (synthetic, public, or the real CSV,
:mod:`raydp.data.splits`) or any table of free text (:mod:`raydp.data.text_source`)."""

from __future__ import annotations

from pathlib import Path

from raydp.data.splits import PUBLIC_SOURCE, build_dataset, load_manifest
from raydp.errors import DataError
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


_VERIFIED_PUBLIC: dict[tuple[str, str], bool] = {}


def is_public_dataset(dataset_dir: str | Path) -> bool:
    """Whether a dataset directory holds raydp's public population and nothing else: its manifest says so
    (``public``, a ``public:`` id of its content) and its split files are exactly what the public generator
    gives for the manifest's parameters, rebuilt here in a temporary directory (a few seconds for 10,000
    records; remembered per directory and content in this process). A hand-edited manifest or a private
    dataset relabelled public is not."""
    import tempfile

    from raydp.data.identity import public_id
    from raydp.data.splits import ALL_SPLITS, load_texts, texts_sha256

    manifest = load_manifest(dataset_dir)
    content = texts_sha256({s: load_texts(dataset_dir, s) for s in ALL_SPLITS})
    if not manifest.get("public") or manifest.get("source") != PUBLIC_SOURCE or \
            manifest.get("dataset_id") != public_id(content):
        return False
    key = (str(Path(dataset_dir).resolve()), content)
    if key not in _VERIFIED_PUBLIC:
        with tempfile.TemporaryDirectory() as tmp:
            rebuilt = build_dataset(Path(tmp) / "public", source=PUBLIC_SOURCE, n_records=manifest.get("n_records"),
                                    seed=manifest.get("seed", 0), fractions=manifest.get("split_fractions"),
                                    generator=manifest.get("generator", "structured"), progress=False)
        _VERIFIED_PUBLIC[key] = rebuilt["content_sha256"] == content
    return _VERIFIED_PUBLIC[key]


def _matches(manifest: dict, data) -> bool:
    """Whether a built dataset's manifest was built from these data settings (the fields that decide its records,
    its splits and its canaries)."""
    import hashlib

    from raydp.data.splits import check_fractions

    # the public population carries no canaries or audit records whatever the settings say (build_dataset)
    n_canary, n_audit = (0, 0) if data.source == PUBLIC_SOURCE else (data.n_canary, data.n_audit)
    common = (manifest.get("seed") == data.seed and manifest.get("n_canary") == n_canary
              and manifest.get("canary_seed") == data.canary_seed and manifest.get("n_audit", 0) == n_audit
              and manifest.get("split_fractions") == check_fractions(data.fractions)
              and manifest.get("sample_fraction") == data.sample_fraction)
    if data.source in ("synthetic", PUBLIC_SOURCE):
        return common and data.text_column is None and manifest.get("source") == data.source \
            and manifest.get("n_records") == data.n_records \
            and manifest.get("generator", "structured") == data.generator
    source = Path(data.source).expanduser()
    if not source.is_file():
        return False
    same_file = manifest.get("source_sha256") == hashlib.sha256(source.read_bytes()).hexdigest()
    if data.text_column is not None:
        return common and same_file and manifest.get("text_source", {}).get("text_column") == data.text_column \
            and manifest.get("text_source", {}).get("unit_column") == data.unit_column
    return common and same_file and "text_source" not in manifest


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
    elif not _matches(load_manifest(build_dir), data):  # a leftover of other settings (another study's, say)
        raise DataError(f"{build_dir} holds a dataset built from other data settings than these: remove it, or use "
                        "another directory (reusing it would train on records these settings do not describe)")
    return build_dir.resolve()
