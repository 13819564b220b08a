"""`python -m keras_ipu`: the `keras-ipu` command."""

from keras_ipu.cli import main

raise SystemExit(main())
