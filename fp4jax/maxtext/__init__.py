"""fp4jax recipes inside MaxText (optional extra: pip install -e ".[maxtext]").

quantization: the Quantization object MaxText's DenseGeneral calls;
pretrain: `python -m fp4jax.maxtext.pretrain <MaxText config> ... fp4jax_recipe=NAME`;
supported_recipes: which fp4jax recipes MaxText can run (imports no MaxText).
"""
