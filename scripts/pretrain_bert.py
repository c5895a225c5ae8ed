"""Pre-train BERT (masked LM + next sentence) with a DeepSpeed config: the whole flow in one readable file.

Copy and adapt it; ``jonebit pretrain`` is the same job with more options (held-out evaluation, HF export, the
embedded Adam vs 1-bit Adam comparison). Multi-host: start one process per host with ``jonebit launch`` (or SLURM /
mpirun); the engine's mesh spans every device of every process.

    python scripts/pretrain_bert.py --config configs/bing_bert_onebit_adam.json --corpus wiki.txt \
        --vocab vocab.txt --model mini --seq-len 128 --batch-size 256 --max-steps 10000 --output runs/bert
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
from flax import nnx

from jonebit.data.pretraining import PretrainingData, PretrainingOptions, build_pretraining_data
from jonebit.data.tokenization import load_wordpiece
from jonebit.models.bert import (
    BertConfig,
    BertForPreTraining,
    position_embedding_mask,
    pretraining_loss,
    save_hf_checkpoint,
)
from jonebit.train.initialize import initialize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="DeepSpeed JSON config")
    ap.add_argument("--corpus", required=True, nargs="+", help="one paragraph per line, blank line between documents")
    ap.add_argument("--vocab", required=True, help="BERT vocab.txt")
    ap.add_argument("--model", default="mini", help="tiny|mini|small|medium|base|large")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, help="override the config's train_batch_size")
    ap.add_argument("--max-steps", type=int, required=True)
    ap.add_argument("--output", default="runs/bert")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = pathlib.Path(args.output)

    # 1. Data: WordPiece, Google-style instances built once into memory-mapped arrays (reused on the next run).
    tokenizer = load_wordpiece(args.vocab)
    options = PretrainingOptions(max_seq_length=args.seq_len, seed=args.seed)
    build_pretraining_data(args.corpus, tokenizer, out / "data", options)
    data = PretrainingData(out / "data", "train")

    # 2. Model, split into the trained parameters and the rest (dropout keys, constants).
    config = BertConfig.preset(args.model, vocab_size=tokenizer.vocab_size, max_position_embeddings=512)
    model = BertForPreTraining(config, rngs=nnx.Rngs(params=args.seed, dropout=args.seed + 1))
    graphdef, params, keys, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)

    def loss_fn(params, batch, rng):  # the engine's key drives dropout: a resumed run repeats it exactly
        fresh = jax.tree.map(lambda x: rng if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x, keys)
        out = nnx.merge(graphdef, params, fresh, rest)(  # the MLM head at the masked positions only
            batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
            masked_positions=batch["masked_lm_positions"], deterministic=False)
        return pretraining_loss(out, batch)

    # 3. The engine from the DeepSpeed config, unchanged but for the batch size this machine can hold.
    ds_config = json.loads(pathlib.Path(args.config).read_text())
    if args.batch_size:
        ds_config["train_batch_size"] = args.batch_size
        ds_config.pop("train_micro_batch_size_per_gpu", None)
        ds_config.pop("gradient_accumulation_steps", None)
    mask = position_embedding_mask(params, seq_len=args.seq_len)  # 1-bit optimizers: unused positions stay zero
    engine = initialize(ds_config, loss_fn, params, exp_avg_mask=mask, rng_seed=args.seed)

    # 4. Train: checkpoints, metrics.jsonl, TensorBoard and a progress bar; a second run resumes where this stopped.
    loop = engine.loop_config(out, args.max_steps, checkpoint_every=1000, tokens_per_example=args.seq_len)
    engine.train(data.batches(engine.batch.train_batch_size, seed=args.seed), loop)
    if jax.process_index() == 0:
        nnx.update(model, jax.device_get(engine.params))
        save_hf_checkpoint(model, out / "hf")  # transformers.BertForPreTraining.from_pretrained(out / "hf") loads it
        tokenizer.save_vocab(out / "hf" / "vocab.txt")
        print(f"metrics: {out / 'metrics.jsonl'}, model: {out / 'hf'}")


if __name__ == "__main__":
    main()
