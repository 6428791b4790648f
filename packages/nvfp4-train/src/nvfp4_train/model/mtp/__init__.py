"""Multi-token prediction: its config (`mtp.config`), its layers (`mtp.layers`), its loss
(`mtp.loss`)."""
