// Declarations of the XLA FFI handler symbols defined in handlers.cc.
#ifndef HERRING_HANDLERS_H_
#define HERRING_HANDLERS_H_

#include "xla/ffi/api/api.h"

namespace herring {

XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringAllReduce);

}  // namespace herring

#endif  // HERRING_HANDLERS_H_
