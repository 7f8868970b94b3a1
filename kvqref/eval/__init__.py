"""Evaluations of KV cache schemes, one module per evaluation.

* :mod:`kvqref.eval.study`: every scheme and engine profile on K/V caches, against the float64 oracle
  (synthetic caches with KIVI's structure, :func:`kvqref.eval.study.kivi_synthetic`);
* :mod:`kvqref.eval.minilm`: real K/V activations of MiniLM-L6 (an encoder), read by kvqref itself;
* :mod:`kvqref.eval.llm`: a decoder LLM (SmolLM2-135M) with a quantized cache: perplexity, KL divergence,
  top-1 and greedy-generation agreement with the unquantized model, passkey retrieval (``kvqref eval``);
* :mod:`kvqref.eval.builtin_caches`: transformers' own quantized caches beside kvqref's matching schemes;
* :mod:`kvqref.eval.rotation`: every study configuration with and without the Hadamard rotation (synthetic);
  :mod:`kvqref.eval.channels`: the per-channel structure of SmolLM2's keys with and without it (``kvqref eval
  --rotation both`` measures the model itself);
* :mod:`kvqref.eval.scales`: what each choice of FP8 scale costs SmolLM2;
* :mod:`kvqref.eval.metrics`: the metrics they share; :mod:`kvqref.eval.texts`: the texts they read.

Nothing here imports transformers directly: the LLM evaluations reach it through :mod:`kvqref.hf`.
"""
