"""FeatCal core: configuration, model adapters, merging and the closed-form calibration math."""
