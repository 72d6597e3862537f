"""Operations services that run beside the cluster (not in the training runtime): remediation."""
