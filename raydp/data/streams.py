"""The synthetic populations' seed-stream tags and id ranges, shared by both generators (:mod:`raydp.data.synthetic`,
:mod:`raydp.data.structured`): a leaf module, so that neither generator imports the other for them."""

# Seed-stream tags: SeedSequence([seed, tag]) keeps the populations statistically independent.
PRIVATE_STREAM = 0x50524956  # "PRIV"
PUBLIC_STREAM = 0x5055424C  # "PUBL"
AUDIT_STREAM = 0x41554454  # "AUDT"
PRETRAINING_STREAM = 0x50524554  # "PRET"
UNSEEN_STREAM = 0x554E534E  # "UNSN"
# Id ranges: private ids start near the real file's smallest ids and grow by < 200 per record, so
# they stay below the public base for any n < 4.5e7; public ids start at 9e9 (the real file's
# largest is 4.4e8).
_ID_BASES = {
    "private": (PRIVATE_STREAM, 12_522, 135),
    "public": (PUBLIC_STREAM, 9_000_000_000, 8_000_000_000),
    # audit canaries (raydp.data.splits): private marginals, ids from 7e9/6e9 (one patient each there)
    "audit": (AUDIT_STREAM, 7_000_000_000, 6_000_000_000),
    # the records that carry the secret canaries (raydp.data.splits): private parameters, ids from 5.5e9/5e9
    "canary": (0x43414E52, 5_500_000_000, 5_000_000_000),  # "CANR"
    # the generic pre-training corpus of the structured generator (raydp.data.structured); ids from 11e9/10e9
    "pretraining": (PRETRAINING_STREAM, 11_000_000_000, 10_000_000_000),
    # another hospital of the structured generator, for proofs on unseen data (raydp.data.structured); ids from
    # 13e9/12e9
    "unseen": (UNSEEN_STREAM, 13_000_000_000, 12_000_000_000),
}
