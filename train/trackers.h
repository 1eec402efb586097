// train/trackers.h: experiment trackers, written by the main process only
// (the Accelerator creates them there): a JSON-lines logger and TensorBoard
// event files (TFRecord framing with masked CRC32C around Event protos).
#ifndef ACCEL_TRAIN_TRACKERS_H_
#define ACCEL_TRAIN_TRACKERS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace accel::train {

class Tracker {
 public:
  virtual ~Tracker() = default;
  virtual const std::string& name() const = 0;  // "jsonl", "tensorboard"
  // The run's hyperparameters (Accelerate's init_trackers config).
  virtual absl::Status StoreConfig(const std::map<std::string, std::string>& config) = 0;
  // Scalars at `step`; each call is flushed to disk before returning.
  virtual absl::Status Log(const std::map<std::string, double>& values, int64_t step) = 0;
  virtual absl::Status Finish() = 0;
};

// logging_dir/run_name/metrics.jsonl, appended: {"config": {...}} per
// StoreConfig, {"step": s, "time": unix seconds, "name": value, ...} per Log
// (a non-finite value is written as null, keeping the line valid JSON).
absl::StatusOr<std::unique_ptr<Tracker>> MakeJsonlTracker(const std::string& logging_dir,
                                                          const std::string& run_name);
// logging_dir/run_name/events.out.tfevents.<time>.<host>.<pid>.<n> (n counts
// the trackers this process opened): a file_version event ("brain.Event:2"),
// then one event per Log holding a scalar summary value per name. StoreConfig
// writes a text summary "hparams" (a Markdown table, TensorBoard's Text tab)
// and logging_dir/run_name/hparams.json; the hparams plugin's protos are not written.
absl::StatusOr<std::unique_ptr<Tracker>> MakeTensorBoardTracker(const std::string& logging_dir,
                                                                const std::string& run_name);
// By name: "jsonl" or "tensorboard"; InvalidArgument listing the known names.
absl::StatusOr<std::unique_ptr<Tracker>> MakeTracker(const std::string& name,
                                                     const std::string& logging_dir,
                                                     const std::string& run_name);

}  // namespace accel::train

#endif  // ACCEL_TRAIN_TRACKERS_H_
