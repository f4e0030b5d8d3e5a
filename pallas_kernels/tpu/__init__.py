"""TPU kernels (Pallas, Mosaic TPU): `ragged_paged_attention_tpu`, run by `attention_backend="pallas-tpu"`
and by "auto" on a TPU; on CPU under the TPU interpreter."""
