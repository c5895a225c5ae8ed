"""Applications built on the library: BERT pre-training (``jonebit pretrain``), SQuAD fine-tuning (``jonebit
squad``, ``squad-download``, ``squad-eval``) and the demo (``make demo``), each with its command line. Their
recipes (the options an application starts from) are config files in ``jonebit/configs/``."""
