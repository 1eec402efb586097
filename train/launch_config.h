// train/launch_config.h: accel-launch's configuration: Accelerate's
// ClusterConfig (default_config.yaml) read from YAML as Accelerate writes it
// or JSON, the launch plan (how many processes, which ranks, which
// environment), and the environment each rank gets (torchrun's contract).
// Torch-free: accel-launch and accel-env link only this (accel-config also
// links libtorch, to count the CUDA devices the ranks will see).
#ifndef ACCEL_TRAIN_LAUNCH_CONFIG_H_
#define ACCEL_TRAIN_LAUNCH_CONFIG_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accel::train {

// The keys of Accelerate's ClusterConfig that accel-launch uses; the rest of
// Accelerate's known keys are accepted and kept in `other` (unknown keys are
// an error, as Accelerate's test_invalid_keys wants) when their values ask
// for nothing accel-launch cannot do. Honoured: compute_environment
// LOCAL_MACHINE, rdzv_backend static, same_network (either value: the
// rendezvous is static), distributed_type NO / MULTI_CPU / MULTI_GPU / FSDP
// with its fsdp_config (exported as Accelerate's FSDP_* variables).
// Refused, naming the key: compute_environment AMAZON_SAGEMAKER, rdzv_backend
// c10d / etcd, a dynamo backend other than NO, a non-empty deepspeed_config /
// megatron_lm_config / parallelism_config / fp8_config, an fsdp_config
// without distributed_type FSDP, an mpirun hostfile, downcast_bf16 other than
// 'no', ipex true, and the other distributed types (DeepSpeed, Megatron, TPU).
struct ClusterConfig {
  std::string compute_environment = "LOCAL_MACHINE";
  std::string distributed_type = "NO";  // NO, MULTI_CPU, MULTI_GPU, FSDP
  std::string mixed_precision = "no";
  bool use_cpu = false;
  bool debug = false;
  int num_processes = 1;
  int num_machines = 1;
  int machine_rank = 0;
  std::string gpu_ids = "all";
  std::string main_process_ip;
  std::optional<int> main_process_port;
  std::string rdzv_backend = "static";
  bool same_network = true;
  std::string main_training_function = "main";
  bool enable_cpu_affinity = false;
  // Known keys accel-launch does not act on (nested sections included), each
  // value as JSON text, so that writing the config back keeps them.
  std::map<std::string, std::string> other;
};

// Parses a config file's text: YAML through yaml-cpp (anything valid:
// anchors and aliases, `<<` merge keys, flow and block style, quoting, block
// scalars, comments), JSON being YAML too. Plain scalars are typed by YAML
// 1.2's core schema (`NO` is text, not false). InvalidArgument naming `source`
// with the line and column for malformed YAML (yaml-cpp's message), duplicate
// keys, unsupported tags, more than one document, a top level that is not a
// mapping; naming the key for a value of the wrong type or range; listing
// unknown keys sorted. Accelerate's legacy forms are converted: `fp16: true`,
// `dynamo_backend: X`, `mixed_precision: false`. distributed_type NO forces
// num_processes 1.
absl::StatusOr<ClusterConfig> ParseClusterConfig(absl::string_view text, absl::string_view source);
absl::StatusOr<ClusterConfig> ReadClusterConfig(const std::string& path);
// JSON (valid YAML) with sorted keys, what `accelerate config` writes; every
// field, `other` included, so it parses back to the same config.
std::string ClusterConfigToJson(const ClusterConfig& config);
// Writes `config` to `path` atomically; AlreadyExists when the file exists
// and !overwrite.
absl::Status WriteClusterConfig(const ClusterConfig& config, const std::string& path,
                                bool overwrite);

// What `accel-config --default` writes (Accelerate's write_basic_config):
// LOCAL_MACHINE, `mixed_precision`, one process per CUDA device (at least
// one), MULTI_GPU for more than one device else NO, debug and
// enable_cpu_affinity false. use_cpu is false: Accelerate writes true when it
// finds no GPU, but a rank without CUDA runs on the CPU anyway, and a file
// written on a CPU-only login node must not keep the GPUs of the machine that
// runs the job idle.
ClusterConfig BasicClusterConfig(const std::string& mixed_precision, int cuda_devices);

// Accelerate's FSDP launch environment (prepare_multi_gpu_env) from the
// fsdp_* settings (config file fsdp_config keys, prefixed fsdp_ where they
// are not, under --fsdp_* flags), values as text: ACCELERATE_USE_FSDP=true,
// FSDP_VERSION (1), FSDP_SHARDING_STRATEGY (FULL_SHARD),
// FSDP_RESHARD_AFTER_FORWARD (true), FSDP_OFFLOAD_PARAMS (false),
// FSDP_MIN_NUM_PARAMS (100000000), FSDP_AUTO_WRAP_POLICY,
// FSDP_TRANSFORMER_CLS_TO_WRAP (fsdp_transformer_layer_cls_to_wrap),
// FSDP_BACKWARD_PREFETCH, FSDP_STATE_DICT_TYPE and FSDP_IGNORED_MODULES when
// set, FSDP_FORWARD_PREFETCH (false), FSDP_USE_ORIG_PARAMS (true),
// FSDP_CPU_RAM_EFFICIENT_LOADING (true), FSDP_SYNC_MODULE_STATES (true),
// FSDP_ACTIVATION_CHECKPOINTING (false); booleans lower-cased. Any other
// setting passes through as FSDP_<NAME>. InvalidArgument for
// cpu_ram_efficient_loading without sync_module_states, as Accelerate.
absl::StatusOr<std::map<std::string, std::string>> FsdpEnvironment(
    const std::map<std::string, std::string>& settings);

// $ACCEL_CONFIG_FILE, else ${XDG_CACHE_HOME:-$HOME/.cache}/accel/default_config.yaml.
std::string DefaultConfigPath();

// What accel-launch starts on this machine.
struct LaunchPlan {
  int num_processes = 1;  // in the whole job
  int num_machines = 1;
  int machine_rank = 0;
  std::string main_process_ip = "127.0.0.1";
  int main_process_port = 29500;
  std::string mixed_precision = "no";
  bool use_cpu = false;
  bool debug = false;  // ACCELERATE_DEBUG_MODE: the ranks' collectives check shapes first
  bool quiet = false;  // --quiet: no notices of accel-launch's own about ranks
  bool enable_cpu_affinity = false;  // ACCELERATE_CPU_AFFINITY; each rank pinned (CpuShare)
  bool use_fsdp = false;             // --use_fsdp or distributed_type FSDP
  std::map<std::string, std::string> fsdp_environment;  // FsdpEnvironment, when use_fsdp
  std::string gpu_ids = "all";                          // else CUDA_VISIBLE_DEVICES
  std::optional<int> threads_per_process;               // --num_cpu_threads_per_process
  double monitor_interval_s = 0.1;                      // how often the ranks are checked
  std::vector<std::string> command;                     // PROGRAM ARGS...
  std::string program_path;                             // PROGRAM found in $PATH

  int local_processes() const { return num_processes / num_machines; }
};

// accel-launch's command line (after the program name), with the config
// file's values underneath the flags. Flags are `--name value` or
// `--name=value`, hyphens or underscores; the first argument that is not a
// flag (or the one after `--`) is PROGRAM, and everything from there on is
// passed through untouched. `env` supplies SLURM_NNODES / SLURM_NODEID
// defaults, PATH, and the config file location ($ACCEL_CONFIG_FILE, else
// ${XDG_CACHE_HOME:-$HOME/.cache}/accel/default_config.yaml when present).
// InvalidArgument naming the flag (or config file) for anything wrong, or
// NotFound naming PROGRAM; nothing is started.
absl::StatusOr<LaunchPlan> ParseLaunchArgs(const std::vector<std::string>& args,
                                           const std::map<std::string, std::string>& env);

// The environment additions of local rank `local_rank` (torchrun's variables
// plus Accelerate's ACCELERATE_*). OMP_NUM_THREADS as Accelerate sets it:
// --num_cpu_threads_per_process, else the existing OMP_NUM_THREADS, else with
// use_cpu `physical_cores` / local processes (at least 1), else 1.
std::map<std::string, std::string> RankEnvironment(const LaunchPlan& plan, int local_rank,
                                                   int physical_cores,
                                                   const std::map<std::string, std::string>& env);

// `name` as execvp would find it: a name with a '/' as is, else the first
// executable regular file in the ':'-separated `path_env` (empty entries are
// the current directory). NotFound naming it otherwise.
absl::StatusOr<std::string> FindProgram(const std::string& name, const std::string& path_env);

// The CPUs local rank `local_rank` of `local_processes` is pinned to with
// enable_cpu_affinity: contiguous, disjoint shares of `allowed` (the
// launcher's own affinity), the first ranks one CPU more when it does not
// divide; with fewer CPUs than ranks, one CPU each, shared round robin.
// (Accelerate pins to the NUMA node of the rank's GPU, through NVML; without
// NVML, an even split of the CPUs is what keeps ranks off each other's cores.)
std::vector<int> CpuShare(const std::vector<int>& allowed, int local_rank, int local_processes);

// Distinct (package, core) pairs in /sys; the logical CPU count when that is
// unreadable. Accelerate divides physical cores among the ranks.
int PhysicalCoreCount();

}  // namespace accel::train

#endif  // ACCEL_TRAIN_LAUNCH_CONFIG_H_
