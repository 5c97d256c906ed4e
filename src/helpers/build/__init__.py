"""Build the bundled tiny Japanese BERT (``make tiny-model``) and the memo-shaped stand-in. Nothing here is taught."""
