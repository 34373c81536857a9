"""The embedded models: tiny local models megarl builds on first use (model.path=embedded:<name>), warm-started on
megarl's own tasks so a demo learns in seconds on a CPU (docs/embedded_model.md). Builders of models, above the
tasks they train on (megarl/rollout/) and the converters every learner and engine uses (megarl/models/)."""
