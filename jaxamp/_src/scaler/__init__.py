"""The loss scaler: dynamic_loss_scale and torch's GradScaler surface (no code shared with
autocast)."""
