output "head_address" {
  description = "Public IPv4 address of the head node: SSH from admin_cidrs only; tunnel the dashboards through it (docs/security.md)."
  value       = try(data.aws_instances.head.public_ips[0], null)
}

output "head_private_address" {
  description = "Private IPv4 address of the head node (the Ray GCS is <this>:6379)."
  value       = try(data.aws_instances.head.private_ips[0], null)
}

output "checkpoint_bucket_name" {
  description = "Name of the checkpoint bucket (storage_path s3://<this>/ray)."
  value       = module.storage.bucket_name
}

output "file_system_id" {
  description = "ID of the shared file system: FSx for Lustre when create_fsx_lustre, else EFS."
  value       = coalesce(module.storage.fsx_lustre_id, module.storage.efs_id)
}

output "total_gpus" {
  description = "GPUs across all pools."
  value       = module.spec.total_gpus
}

output "inventory" {
  description = "Ansible inventory YAML; `make cluster-up-aws` writes it to ansible/inventories/aws/hosts.yml."
  value       = module.spec.inventory
}

output "mlflow_artifacts_user_name" {
  description = "IAM user the MLflow server reaches mlflow/ of the bucket as. Terraform makes no key for it (the secret would sit in the state): run `aws iam create-access-key --user-name <this>` and put the pair in the vault as mlflow_artifact_store_access_key_id / mlflow_artifact_store_secret_access_key."
  value       = aws_iam_user.mlflow_artifacts.name
}
