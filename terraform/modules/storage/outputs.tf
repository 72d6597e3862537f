output "bucket_name" {
  description = "Name of the checkpoint bucket."
  value       = aws_s3_bucket.this.bucket
}

output "bucket_arn" {
  description = "ARN of the checkpoint bucket (what the node IAM policy is scoped to)."
  value       = aws_s3_bucket.this.arn
}

output "efs_id" {
  description = "ID of the EFS file system, or null when create_efs is false."
  value       = try(aws_efs_file_system.this[0].id, null)
}

output "efs_dns_name" {
  description = "DNS name nodes mount the EFS file system from, or null."
  value       = try(aws_efs_file_system.this[0].dns_name, null)
}

output "fsx_lustre_id" {
  description = "ID of the FSx for Lustre file system, or null when create_fsx_lustre is false."
  value       = try(aws_fsx_lustre_file_system.this[0].id, null)
}

output "fsx_lustre_mount_source" {
  description = "Lustre mount source ('<dns>@tcp:/<mount name>'), or null."
  value       = try("${aws_fsx_lustre_file_system.this[0].dns_name}@tcp:/${aws_fsx_lustre_file_system.this[0].mount_name}", null)
}

output "shared_filesystem" {
  description = "The shared file system for cluster_spec's inventory ({ type, source }): FSx for Lustre when created, else EFS, else null."
  value = (
    var.create_fsx_lustre ? { type = "fsx_lustre", source = "${aws_fsx_lustre_file_system.this[0].dns_name}@tcp:/${aws_fsx_lustre_file_system.this[0].mount_name}" } :
    var.create_efs ? { type = "efs", source = aws_efs_file_system.this[0].dns_name } : null
  )
}
