"""fp4jax recipes inside MaxText (optional extra: pip install -e ".[maxtext]").

quantization: the Quantization object MaxText's DenseGeneral calls;
train: `python -m fp4jax.maxtext.train <MaxText config> ... fp4jax_recipe=NAME`;
recipe: which fp4jax recipes MaxText can run (imports no MaxText).
"""
