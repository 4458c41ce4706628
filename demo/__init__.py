"""Demo-model making, offline: the demo-coder's corpus, conversations, tokenizer, training and
checkpoint validation (`kvcellar model train`). Serving never imports this room; what serve loads
at run time (`engine/demo_models.py`, `engine/hub.py`, `engine/assets/`) stays in `engine/`."""
