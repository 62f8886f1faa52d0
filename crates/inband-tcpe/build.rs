fn main() {
    inband_bpf_build::skeletons(&["tcpe"]);
    inband_bpf_build::shared_types(&["tcpe/wire.h", "tcpe/consts.h", "tcpe/types.h"]);
}
