//! Reaching the memory of Python tensors without copying: numpy's `__array_interface__`,
//! torch's `data_ptr()` / `shape` / `stride()` / `dtype` / `device`, or a DLPack capsule
//! (`__dlpack__`). The Python object (or the DLPack managed tensor) stays referenced for as long
//! as awex holds the view, so the memory stays valid.

use crate::errors::{Fail, Result};
use awex_core::DType;
use awex_core::layout::{Dims, MAX_DIMS};
use awex_runtime::TensorView;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::ffi::{c_char, c_void};

/// A registered tensor: awex's view of its memory and what keeps that memory alive.
pub(crate) struct Held {
    /// The view the runtime reads or writes.
    pub view: TensorView,
    /// The registered Python object.
    _object: Py<PyAny>,
    /// The DLPack managed tensor this view came from, released when the view is dropped.
    _dlpack: Option<DlpackOwner>,
}

/// Maps a numpy type string (`<f4`) to a dtype.
pub(crate) fn dtype_of_typestr(typestr: &str) -> Option<DType> {
    let b = typestr.as_bytes();
    if b.len() < 3 {
        return None;
    }
    let little = cfg!(target_endian = "little");
    let order_ok = match b[0] {
        b'<' => little,
        b'>' => !little,
        b'|' | b'=' => true,
        _ => false,
    };
    if !order_ok {
        return None;
    }
    Some(match &typestr[1..] {
        "f2" => DType::F16,
        "f4" => DType::F32,
        "f8" => DType::F64,
        "u1" => DType::U8,
        "i1" => DType::I8,
        "i4" => DType::I32,
        "i8" => DType::I64,
        _ => return None,
    })
}

/// Maps a numpy dtype name (`float32`, `bfloat16` from ml_dtypes) to a dtype.
pub(crate) fn dtype_of_name(name: &str) -> Option<DType> {
    let n = name.strip_prefix("torch.").unwrap_or(name);
    Some(match n {
        "bfloat16" => DType::Bf16,
        "float16" | "half" => DType::F16,
        "float32" | "float" => DType::F32,
        "float64" | "double" => DType::F64,
        "uint8" => DType::U8,
        "int8" => DType::I8,
        "int32" | "int" => DType::I32,
        "int64" | "long" => DType::I64,
        "float8_e4m3fn" => DType::F8E4m3,
        _ => return None,
    })
}

/// Maps a DLPack dtype (code, bits, lanes) to a dtype.
pub(crate) fn dtype_of_dlpack(code: u8, bits: u8, lanes: u16) -> Option<DType> {
    if lanes != 1 {
        return None;
    }
    Some(match (code, bits) {
        (0, 8) => DType::I8,
        (0, 32) => DType::I32,
        (0, 64) => DType::I64,
        (1, 8) => DType::U8,
        (2, 16) => DType::F16,
        (2, 32) => DType::F32,
        (2, 64) => DType::F64,
        (4, 16) => DType::Bf16,
        // DLPack 1.1 `kDLFloat8_e4m3fn` (torch.float8_e4m3fn: FP8 engine weights)
        (10, 8) => DType::F8E4m3,
        _ => return None,
    })
}

/// Whether `strides` (in units of `unit` per element step) describe a C-contiguous `shape`.
pub(crate) fn c_contiguous(shape: &[u64], strides: &[i64], unit: i64) -> bool {
    if strides.len() != shape.len() {
        return false;
    }
    if shape.contains(&0) {
        return true;
    }
    let mut want = unit;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        // a dimension of one element may carry any stride
        if n != 1 && s != want {
            return false;
        }
        want = want.saturating_mul(n as i64);
    }
    true
}

const SUPPORTED: &str = "awex moves float32, float16, bfloat16, float64, uint8, int8, int32, int64 and float8_e4m3fn tensors";

/// Why a tensor is not C-contiguous, as a layout error.
fn not_contiguous(name: &str, shape: &[u64], strides: &[i64], unit: &str) -> Fail {
    Fail::Layout(format!(
        "`{name}` is not C-contiguous (shape {shape:?}, strides {strides:?} {unit}); register a contiguous tensor (numpy.ascontiguousarray / tensor.contiguous()) that awex can address in place"
    ))
}

/// Builds the view once pointer, shape and dtype are known.
fn view(name: &str, ptr: usize, shape: &[u64], dtype: DType) -> Result<TensorView> {
    if shape.len() > MAX_DIMS {
        return Err(Fail::Layout(format!(
            "`{name}` has {} dimensions; awex tensors have at most {MAX_DIMS}",
            shape.len()
        )));
    }
    let dims = Dims::new(shape);
    let len = shape
        .iter()
        .try_fold(dtype.size() as u64, |a, &n| a.checked_mul(n))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| Fail::Layout(format!("`{name}`: shape {shape:?} is too large")))?;
    // SAFETY: the pointer and length describe the registered object's memory, which the `Held`
    // keeps alive; the contract of the Writer/Reader (documented) is that nothing else touches it
    // while an update runs.
    unsafe { TensorView::new(name, ptr as *mut u8, len, dtype, dims) }.map_err(Fail::from)
}

/// Which memory a rank's transport moves, and so which tensors `register` accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Accept {
    /// Host memory (`shm`, `tcp`).
    Host,
    /// GPU memory (`cuda-ipc`, `nccl`, the transport named): torch CUDA tensors or DLPack
    /// CUDA capsules.
    Cuda(&'static str),
}

/// Whether this build of awex can address GPU memory (the crate's `cuda` feature).
pub(crate) const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Why a tensor on a GPU cannot be registered with `accept`, or `None` when it can.
pub(crate) fn refuse_device(name: &str, device: &str, accept: Accept) -> Option<Fail> {
    if !CUDA_BUILT {
        return Some(Fail::Value(format!(
            "`{name}` lives on `{device}`, but awex was built without CUDA (the `cuda` feature of awex-py); rebuild it with `maturin build --features cuda` to register GPU tensors over the cuda-ipc or nccl transport, or register CPU tensors"
        )));
    }
    match accept {
        Accept::Cuda(_) => None,
        Accept::Host => Some(Fail::Value(format!(
            "`{name}` lives on `{device}`, but this rank's transport moves host memory; register CPU tensors, or connect the pair with transport=\"cuda-ipc\" (one host) or \"nccl\" to move GPU tensors"
        ))),
    }
}

/// Why a host tensor cannot be registered with `accept`, or `None` when it can.
pub(crate) fn refuse_host(name: &str, accept: Accept) -> Option<Fail> {
    match accept {
        Accept::Host => None,
        Accept::Cuda(transport) => Some(Fail::Value(format!(
            "`{name}` lives in host memory, but the {transport} transport moves GPU memory; register CUDA tensors (tensor.cuda()), or use the shm or tcp transport"
        ))),
    }
}

/// Builds a device view once pointer, shape, dtype and GPU are known.
#[cfg(feature = "cuda")]
fn device_view(
    name: &str,
    ptr: u64,
    shape: &[u64],
    dtype: DType,
    device: u32,
) -> Result<TensorView> {
    if shape.len() > MAX_DIMS {
        return Err(Fail::Layout(format!(
            "`{name}` has {} dimensions; awex tensors have at most {MAX_DIMS}",
            shape.len()
        )));
    }
    let len = shape
        .iter()
        .try_fold(dtype.size() as u64, |a, &n| a.checked_mul(n))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| Fail::Layout(format!("`{name}`: shape {shape:?} is too large")))?;
    // SAFETY: the pointer and length describe the registered tensor's GPU memory, which the
    // `Held` keeps alive (the tensor stays referenced); the Writer/Reader contract is that
    // nothing else writes it while an update runs.
    unsafe { TensorView::new_cuda(name, ptr, len, dtype, Dims::new(shape), device) }
        .map_err(Fail::from)
}

/// Without the `cuda` feature no device view can be built.
#[cfg(not(feature = "cuda"))]
fn device_view(name: &str, _: u64, _: &[u64], _: DType, device: u32) -> Result<TensorView> {
    Err(
        refuse_device(name, &format!("cuda:{device}"), Accept::Cuda("cuda-ipc"))
            .unwrap_or_else(|| Fail::Value(format!("`{name}`: awex was built without CUDA"))),
    )
}

/// Reads a registered object's memory; `writable` is required on the receiving side, `accept`
/// says which memory the rank's transport moves.
pub(crate) fn hold(
    name: &str,
    obj: &Bound<'_, PyAny>,
    writable: bool,
    accept: Accept,
) -> Result<Held> {
    let py = obj.py();
    if obj.hasattr("__array_interface__")? {
        if let Some(e) = refuse_host(name, accept) {
            return Err(e);
        }
        let view = from_array_interface(name, obj, writable)?;
        return Ok(Held {
            view,
            _object: obj.clone().unbind(),
            _dlpack: None,
        });
    }
    if obj.hasattr("data_ptr")? && obj.hasattr("stride")? && obj.hasattr("device")? {
        let view = from_torch(name, obj, accept)?;
        return Ok(Held {
            view,
            _object: obj.clone().unbind(),
            _dlpack: None,
        });
    }
    if obj.hasattr("__dlpack__")? {
        let (view, owner) = from_dlpack(py, name, obj, accept)?;
        return Ok(Held {
            view,
            _object: obj.clone().unbind(),
            _dlpack: Some(owner),
        });
    }
    let ty = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into());
    Err(Fail::Type(format!(
        "`{name}`: a `{ty}` exposes neither `__dlpack__`, `__array_interface__` nor torch's `data_ptr()`; register numpy arrays or torch tensors"
    )))
}

fn from_array_interface(name: &str, obj: &Bound<'_, PyAny>, writable: bool) -> Result<TensorView> {
    let ai = obj.getattr("__array_interface__")?;
    let ai = ai
        .cast::<PyDict>()
        .map_err(|_| Fail::Type(format!("`{name}`: `__array_interface__` is not a dict")))?;
    let item = |k: &str| -> Result<Bound<'_, PyAny>> {
        ai.get_item(k)?
            .ok_or_else(|| Fail::Type(format!("`{name}`: `__array_interface__` has no `{k}`")))
    };
    let data = item("data")?;
    let data = data.cast::<PyTuple>().map_err(|_| {
        Fail::Type(format!(
            "`{name}`: `__array_interface__['data']` is not a (pointer, read-only) tuple"
        ))
    })?;
    if data.len() != 2 {
        return Err(Fail::Type(format!(
            "`{name}`: `__array_interface__['data']` is not a (pointer, read-only) tuple"
        )));
    }
    let ptr: usize = data.get_item(0)?.extract()?;
    let readonly: bool = data.get_item(1)?.extract()?;
    if readonly && writable {
        return Err(Fail::Value(format!(
            "`{name}` is read-only; an inference rank writes into its tensors, so register writable arrays"
        )));
    }
    let shape: Vec<u64> = item("shape")?.extract()?;
    let typestr: String = item("typestr")?.extract()?;
    let dtype = match dtype_of_typestr(&typestr) {
        Some(d) => d,
        None => {
            // ml_dtypes' bfloat16 is a void type string (`<V2`) with the dtype name `bfloat16`
            let dname: Option<String> = obj
                .getattr("dtype")
                .and_then(|d| d.getattr("name"))
                .and_then(|n| n.extract())
                .ok();
            match dname.as_deref().and_then(dtype_of_name) {
                Some(d) if typestr.ends_with(&d.size().to_string()) => d,
                _ => {
                    return Err(Fail::Layout(format!(
                        "`{name}` has dtype {} (type string `{typestr}`), which awex cannot move; {SUPPORTED}",
                        dname.unwrap_or_else(|| "?".into())
                    )));
                }
            }
        }
    };
    if let Some(strides) = ai.get_item("strides")?.filter(|s| !s.is_none()) {
        let strides: Vec<i64> = strides.extract()?;
        if !c_contiguous(&shape, &strides, dtype.size() as i64) {
            return Err(not_contiguous(name, &shape, &strides, "bytes"));
        }
    }
    view(name, ptr, &shape, dtype)
}

fn from_torch(name: &str, obj: &Bound<'_, PyAny>, accept: Accept) -> Result<TensorView> {
    let device = obj.getattr("device")?;
    let kind: String = device.getattr("type")?.extract()?;
    let gpu = match kind.as_str() {
        "cpu" => {
            if let Some(e) = refuse_host(name, accept) {
                return Err(e);
            }
            None
        }
        "cuda" => {
            if let Some(e) = refuse_device(name, &device.str()?.to_string(), accept) {
                return Err(e);
            }
            let index: Option<u32> = device.getattr("index")?.extract()?;
            Some(index.unwrap_or(0))
        }
        _ => {
            return Err(Fail::Value(format!(
                "`{name}` lives on `{}`; awex moves CPU tensors (shm, tcp) and CUDA tensors (cuda-ipc)",
                device.str()?
            )));
        }
    };
    let dtype_text = obj.getattr("dtype")?.str()?.to_string();
    let dtype = dtype_of_name(&dtype_text).ok_or_else(|| {
        Fail::Layout(format!(
            "`{name}` has dtype {dtype_text}, which awex cannot move; {SUPPORTED}"
        ))
    })?;
    let shape: Vec<u64> = obj.getattr("shape")?.extract()?;
    let strides: Vec<i64> = obj.call_method0("stride")?.extract()?;
    if !c_contiguous(&shape, &strides, 1) {
        return Err(not_contiguous(name, &shape, &strides, "elements"));
    }
    let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
    match gpu {
        Some(device) => device_view(name, ptr as u64, &shape, dtype, device),
        None => view(name, ptr, &shape, dtype),
    }
}

/// DLPack's `DLDevice`.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// DLPack's `DLDataType`.
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// DLPack's `DLTensor`.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// DLPack's (unversioned) `DLManagedTensor`.
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// A consumed DLPack capsule's managed tensor; its producer's deleter runs on drop.
pub(crate) struct DlpackOwner(*mut DlManagedTensor);

// SAFETY: the managed tensor is only read (shape, pointer) and finally released through its
// deleter, with the interpreter attached; DLPack producers allow this from any thread.
unsafe impl Send for DlpackOwner {}
// SAFETY: as above; no interior mutation happens through a shared reference.
unsafe impl Sync for DlpackOwner {}

impl Drop for DlpackOwner {
    fn drop(&mut self) {
        let ptr = self.0;
        // SAFETY: `ptr` came from a capsule awex consumed (renamed `used_dltensor`), so awex owns
        // it and calls its deleter exactly once; producers such as numpy need the interpreter.
        let release = move || unsafe {
            if let Some(d) = (*ptr).deleter {
                d(ptr)
            }
        };
        // during interpreter shutdown the producer's memory goes away with it
        let _ = Python::try_attach(|_| release());
    }
}

const DLTENSOR: &std::ffi::CStr = c"dltensor";
const USED_DLTENSOR: &std::ffi::CStr = c"used_dltensor";
/// DLPack device types awex can address from the CPU: kDLCPU, kDLCUDAHost, kDLCUDAManaged.
const HOST_DEVICES: [i32; 3] = [1, 3, 13];
/// DLPack's kDLCUDA: GPU memory, addressed as a device view.
const CUDA_DEVICE: i32 = 2;

fn from_dlpack(
    py: Python<'_>,
    name: &str,
    obj: &Bound<'_, PyAny>,
    accept: Accept,
) -> Result<(TensorView, DlpackOwner)> {
    let capsule = obj.call_method0("__dlpack__")?;
    let raw = capsule.as_ptr();
    // SAFETY: plain capsule API calls on a live object, with the interpreter attached.
    let managed = unsafe {
        if pyo3::ffi::PyCapsule_IsValid(raw, DLTENSOR.as_ptr()) != 1 {
            return Err(Fail::Type(format!(
                "`{name}`: `__dlpack__()` did not return a `dltensor` capsule"
            )));
        }
        let p = pyo3::ffi::PyCapsule_GetPointer(raw, DLTENSOR.as_ptr()) as *mut DlManagedTensor;
        if p.is_null() {
            return Err(PyErr::fetch(py).into());
        }
        // consumed: the capsule's destructor must no longer free it
        if pyo3::ffi::PyCapsule_SetName(raw, USED_DLTENSOR.as_ptr() as *const c_char) != 0 {
            return Err(PyErr::fetch(py).into());
        }
        p
    };
    let owner = DlpackOwner(managed);
    // SAFETY: the managed tensor is valid until its deleter runs (owned by `owner`).
    let t = unsafe { &(*managed).dl_tensor };
    let gpu = if HOST_DEVICES.contains(&t.device.device_type) {
        if let Some(e) = refuse_host(name, accept) {
            return Err(e);
        }
        None
    } else if t.device.device_type == CUDA_DEVICE {
        let id = t.device.device_id;
        if let Some(e) = refuse_device(name, &format!("cuda:{id}"), accept) {
            return Err(e);
        }
        Some(
            u32::try_from(id)
                .map_err(|_| Fail::Type(format!("`{name}`: DLPack device id {id} is negative")))?,
        )
    } else {
        return Err(Fail::Value(format!(
            "`{name}` lives on DLPack device type {} (id {}); awex moves CPU memory (shm, tcp) and CUDA memory (cuda-ipc)",
            t.device.device_type, t.device.device_id
        )));
    };
    let dtype = dtype_of_dlpack(t.dtype.code, t.dtype.bits, t.dtype.lanes).ok_or_else(|| {
        Fail::Layout(format!(
            "`{name}` has DLPack dtype (code {}, bits {}, lanes {}), which awex cannot move; {SUPPORTED}",
            t.dtype.code, t.dtype.bits, t.dtype.lanes
        ))
    })?;
    let ndim = usize::try_from(t.ndim).unwrap_or(0);
    let read = |p: *const i64| -> Vec<i64> {
        if p.is_null() || ndim == 0 {
            return Vec::new();
        }
        // SAFETY: DLPack guarantees `ndim` entries behind shape (and strides when not null).
        unsafe { std::slice::from_raw_parts(p, ndim) }.to_vec()
    };
    let shape_i = read(t.shape);
    if shape_i.iter().any(|&n| n < 0) {
        return Err(Fail::Type(format!(
            "`{name}`: DLPack shape {shape_i:?} has a negative size"
        )));
    }
    let shape: Vec<u64> = shape_i.iter().map(|&n| n as u64).collect();
    if !t.strides.is_null() {
        let strides = read(t.strides);
        if !c_contiguous(&shape, &strides, 1) {
            return Err(not_contiguous(name, &shape, &strides, "elements"));
        }
    }
    let ptr = (t.data as usize).wrapping_add(t.byte_offset as usize);
    let v = match gpu {
        Some(device) => device_view(name, ptr as u64, &shape, dtype, device)?,
        None => view(name, ptr, &shape, dtype)?,
    };
    Ok((v, owner))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typestrs_map_to_awex_dtypes_and_refuse_the_rest() {
        assert_eq!(dtype_of_typestr("<f4"), Some(DType::F32));
        assert_eq!(dtype_of_typestr("<f2"), Some(DType::F16));
        assert_eq!(dtype_of_typestr("|u1"), Some(DType::U8));
        assert_eq!(dtype_of_typestr("|i1"), Some(DType::I8));
        assert_eq!(dtype_of_typestr("<i8"), Some(DType::I64));
        assert_eq!(dtype_of_typestr(">f4"), None, "big endian");
        assert_eq!(dtype_of_typestr("<c8"), None, "complex");
        assert_eq!(dtype_of_typestr("<V2"), None, "void needs the dtype name");
        assert_eq!(dtype_of_typestr("<"), None);
    }

    #[test]
    fn torch_and_numpy_names_map_to_awex_dtypes() {
        assert_eq!(dtype_of_name("torch.bfloat16"), Some(DType::Bf16));
        assert_eq!(dtype_of_name("bfloat16"), Some(DType::Bf16));
        assert_eq!(dtype_of_name("torch.float32"), Some(DType::F32));
        assert_eq!(dtype_of_name("torch.int64"), Some(DType::I64));
        assert_eq!(dtype_of_name("torch.complex64"), None);
        assert_eq!(dtype_of_name("torch.bool"), None);
    }

    #[test]
    fn dlpack_codes_map_to_awex_dtypes() {
        assert_eq!(dtype_of_dlpack(4, 16, 1), Some(DType::Bf16));
        assert_eq!(dtype_of_dlpack(2, 32, 1), Some(DType::F32));
        assert_eq!(dtype_of_dlpack(1, 8, 1), Some(DType::U8));
        assert_eq!(
            dtype_of_dlpack(10, 8, 1),
            Some(DType::F8E4m3),
            "float8_e4m3fn"
        );
        assert_eq!(dtype_of_dlpack(12, 8, 1), None, "float8_e5m2");
        assert_eq!(dtype_of_dlpack(2, 32, 4), None, "vector lanes");
        assert_eq!(dtype_of_dlpack(5, 64, 1), None, "complex");
    }

    /// The message of a `ValueError`.
    fn value(f: Option<Fail>) -> Option<String> {
        match f {
            None => None,
            Some(Fail::Value(m)) => Some(m),
            Some(other) => Some(format!("not a ValueError: {other:?}")),
        }
    }

    #[test]
    fn gpu_tensors_are_refused_with_the_reason() {
        let host = value(refuse_device("w", "cuda:0", Accept::Host));
        let ipc = value(refuse_device("w", "cuda:0", Accept::Cuda("cuda-ipc")));
        if CUDA_BUILT {
            assert_eq!(ipc, None);
            assert_eq!(
                host.as_deref(),
                Some(
                    "`w` lives on `cuda:0`, but this rank's transport moves host memory; register CPU tensors, or connect the pair with transport=\"cuda-ipc\" (one host) or \"nccl\" to move GPU tensors"
                )
            );
        } else {
            let want = "`w` lives on `cuda:0`, but awex was built without CUDA (the `cuda` feature of awex-py); rebuild it with `maturin build --features cuda` to register GPU tensors over the cuda-ipc or nccl transport, or register CPU tensors";
            assert_eq!(host.as_deref(), Some(want));
            assert_eq!(ipc.as_deref(), Some(want));
        }
        assert_eq!(value(refuse_host("w", Accept::Host)), None);
        for t in ["cuda-ipc", "nccl"] {
            assert_eq!(
                value(refuse_host("w", Accept::Cuda(t))),
                Some(format!(
                    "`w` lives in host memory, but the {t} transport moves GPU memory; register CUDA tensors (tensor.cuda()), or use the shm or tcp transport"
                ))
            );
        }
    }

    #[test]
    fn contiguity_ignores_unit_dims_and_empty_tensors() {
        assert!(c_contiguous(&[2, 3], &[12, 4], 4));
        assert!(!c_contiguous(&[2, 3], &[4, 8], 4), "transposed");
        assert!(!c_contiguous(&[2, 3], &[24, 8], 4), "every other column");
        assert!(c_contiguous(&[1, 3], &[999, 1], 1));
        assert!(c_contiguous(&[0, 3], &[5, 7], 1));
        assert!(c_contiguous(&[], &[], 1));
        assert!(!c_contiguous(&[2], &[], 1), "stride count differs");
    }
}
