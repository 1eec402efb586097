// Where the embedded default model lives, for the tools that fall back to it.
#ifndef ACCEL_MODELS_DEFAULT_MODEL_H_
#define ACCEL_MODELS_DEFAULT_MODEL_H_

#include <string>

namespace accel::models {

// The model accel-serve and accel-generate use when no --model is given:
// $ACCEL_DEFAULT_MODEL if set, otherwise share/accel/default-model beside the
// running binary's bin/ folder (where the build and the image put it).
std::string DefaultModelDir();

}  // namespace accel::models

#endif  // ACCEL_MODELS_DEFAULT_MODEL_H_
