"""Inference engines behind one async interface (``base.Engine``): the embedded torch engine (``local``) and a
scripted engine for unit tests of scheduling logic (``scripted``)."""
