"""The training data: the sources, the global sample stream and the data loaders (``loaders``), token shards on disk
(``shards``) and in S3 (``s3shards``), ``kubetitan prepare-data`` (``prepare``, ``prepare_job``), the tokenizer, and
hub downloads."""
