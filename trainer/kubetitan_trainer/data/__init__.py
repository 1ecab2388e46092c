"""The training data: the sources and the global sample stream (``stream``, torch-free), the data loaders over it
(``loaders``), token shards on disk (``shards``) and in S3 (``s3shards``), ``kubetitan prepare-data`` (``prepare``,
``prepare_job``), the tokenizer, and hub downloads."""
