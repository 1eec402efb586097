#include "server/internal/parallel_worker.h"

#include <cstdio>
#include <memory>

#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include "absl/strings/str_cat.h"

#include "dist/process_group.h"
#include "models/load_model.h"
#include "models/tensor_parallel.h"

namespace accel::server::internal {
namespace {

void Log(int rank, const std::string& message) {
  std::fprintf(stderr, "accel-serve: worker rank %d: %s\n", rank, message.c_str());
  std::fflush(stderr);
}

}  // namespace

int ServeWorkerRank(const std::string& model_dir, models::ModelLoadOptions load,
                    const std::string& host, int port, dist::ProcessGroup& group) {
  const int rank = group.rank();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(absl::StrCat(host, ":", port), grpc::InsecureServerCredentials(),
                           &bound);
  std::unique_ptr<grpc::Server> health = builder.BuildAndStart();
  if (health == nullptr || bound == 0) {
    Log(rank, absl::StrCat("cannot listen on ", host, ":", port));
    return 1;
  }
  grpc::HealthCheckServiceInterface* service = health->GetHealthCheckService();
  service->SetServingStatus("", true);
  service->SetServingStatus("accel.live", true);
  service->SetServingStatus("accel.ready", false);
  // On stderr: stdout's first line is the leader's (scripts read its ports).
  Log(rank, absl::StrCat("listening grpc=", host, ":", bound, " (health only)"));

  if (!load.tensor_parallel.split()) {
    // Tensor parallel over the whole group, unless the caller placed it.
    load.tensor_parallel.rank = rank;
    load.tensor_parallel.size = group.size();
    load.tensor_parallel.group = &group;
  }
  absl::StatusOr<models::LoadedModel> loaded = models::LoadModel(model_dir, load);
  if (!loaded.ok()) {
    Log(rank, absl::StrCat("cannot load its slice of the model: ", loaded.status().message()));
    return 1;
  }
  service->SetServingStatus("accel.ready", true);
  Log(rank, absl::StrCat("ready: ", group.size(), " ranks; running the leader's steps"));
  const absl::Status ran =
      models::RunTensorParallelWorker(*loaded->model, loaded->dispatched.get(), group);
  service->SetServingStatus("accel.ready", false);
  health->Shutdown();
  if (!ran.ok()) {
    Log(rank, absl::StrCat(ran.message(), "; exiting with status ", kExitParallelFault));
    return kExitParallelFault;
  }
  Log(rank, "the leader stopped the group; exiting");
  return 0;
}

}  // namespace accel::server::internal
